"""The machine's weight-streaming roofline for batch-1 decode, measured in the run.

A batch-1 decode step reads every weight once, so on a CPU its ceiling is the rate at
which the machine streams the weights through a matrix-vector product. This module
measures that rate where the benchmark runs: a jitted float32 ``W @ x`` over a
matrix of the model's float32 weight bytes (best of ``repeats``), and turns it into

    roofline tok/s = matvec bytes/s / weight bytes

`jaxengine.benchmarks.latency` reports batch-1 decode as a fraction of it. The same product with
bfloat16 or int8 weights (converted to float32 inside the jitted function, as a
float32 engine would compute) shows whether smaller weights help on this backend.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from jaxengine.benchmarks.common import ModelFiles
from jaxengine.extras import require_torch

COLUMNS = 2048  # the matrix is [weight elements / COLUMNS, COLUMNS]


@dataclass(frozen=True)
class Roofline:
    weight_bytes: int  # the model's parameters in float32
    matvec_bytes_per_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.matvec_bytes_per_s / self.weight_bytes

    def to_json(self) -> dict[str, float]:
        return {
            "weight_bytes": self.weight_bytes,
            "matvec_gb_per_s": self.matvec_bytes_per_s / 1e9,
            "roofline_tokens_per_s": self.tokens_per_s,
        }


def model_weight_bytes(files: ModelFiles) -> int:
    """Float32 bytes of the model's parameters (tied embeddings once), from its config
    (a meta-device model: nothing is allocated)."""
    require_torch("the latency benchmark's roofline (--no-roofline skips it)")
    import torch
    import transformers

    from jaxengine.loader.hf_config import load_hf_config

    config = load_hf_config(files.gguf or files.folder)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return 4 * sum(p.numel() for p in model.parameters())


def matvec_seconds(num_bytes: int, dtype: str = "float32", repeats: int = 7) -> float:
    """Best seconds of a jitted ``W @ x`` whose float32 matrix has ``num_bytes``; the
    matrix is stored in ``dtype`` and converted to float32 inside the product."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rows = max(num_bytes // (4 * COLUMNS), 1)
    key = jax.random.PRNGKey(0)
    w = jax.random.normal(key, (rows, COLUMNS), jnp.float32)
    if dtype == "int8":
        w = jnp.clip(w * 32, -127, 127).astype(jnp.int8)
    else:
        w = w.astype(dtype)
    x = jnp.asarray(np.random.default_rng(0).standard_normal(COLUMNS), jnp.float32)
    fn = jax.jit(lambda w, x: w.astype(jnp.float32) @ x)
    fn(w, x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(w, x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    del w
    return best


def measure(files: ModelFiles, repeats: int = 7) -> Roofline:
    weight_bytes = model_weight_bytes(files)
    return Roofline(weight_bytes, weight_bytes / matvec_seconds(weight_bytes, repeats=repeats))
