"""The kernels section: the engine's attention path against the XLA reference.

Three workloads, in the Llama-3-8B head layout (32 query heads, 8 KV heads, head dim
128; tiny heads in the dry run), bfloat16, pages of 16 scattered over the cache
(`bench.kernels.make_arrays`):

- ``decode``: 64 requests x 1 token over 2,048 cached (`bench.kernels.workloads`);
- ``mixed``: 60 of those decodes and 4 prefill chunks of 128 tokens;
- ``prefill``: 4 fresh prompts of 2,048 tokens.

Two peers on the same data: ``engine``, the attention the engine runs on this
platform (``--attention-backend auto``: the Pallas Triton kernel on a GPU, the
request-major ``xla-cpu`` path on a CPU), and ``reference``, the pure-JAX reference
(its output checks the engine's: ``max_err``). The reference gathers each token's
pages once per 64 keys (float32 copies of K and V per token: 4 GiB per loop step for
the GPU prefill), so it is left out where those would pass ``REFERENCE_MAX_BYTES``,
and a reference that fails (memory) leaves the engine's figures standing.

Figures: median seconds, the effective bandwidth (`cost.batch_cost`'s bytes over the
time) and its fraction of the run's copy bandwidth, TFLOP/s and its fraction of the
run's bf16 matmul rate. The goals: decode >= 70% of copy bandwidth, prefill >= 50%
of the matmul rate.

Then the block sweep (`bench.device.sweep`): the Pallas GPU kernel's tile options on
the prefill and mixed workloads (``sweep_prefill``, ``sweep_mixed``), each checked
against the reference, TFLOP/s against the sheet's bf16 peak, the best config named.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from bench.device.profile import Profile

REFERENCE_MAX_BYTES = 8 << 30


def workloads(profile: Profile) -> list:
    from bench.kernels import Workload, workloads

    decode, mixed = workloads(small=profile.small_model)
    if profile.small_model:
        prefill = dataclasses.replace(mixed, name="prefill", q_lens=(32, 32), seq_lens=(32, 32))
    else:
        prefill = Workload("prefill", (2048,) * 4, (2048,) * 4)
    return [decode, prefill, mixed]


def reference_bytes(w: Any) -> int:
    """Float32 temporaries of one reference loop step: each token's 64 keys' K and V."""
    return sum(w.q_lens) * 64 * 2 * w.num_kv_heads * w.head_dim * 4


def peers(w: Any) -> dict[str, Any]:
    from jaxengine.runner.attention_backend import select_attention_backend
    from pallas_kernels.ragged_paged_attention import reference

    out = {"engine": select_attention_backend("auto").attention_fn}
    if reference_bytes(w) <= REFERENCE_MAX_BYTES:
        out["reference"] = reference.ragged_paged_attention
    return out


def measure(w: Any, profile: Profile, denominators: dict[str, float]) -> dict[str, Any]:
    """Both peers on workload ``w``: timings, fractions, and the engine's error."""
    import jax
    import jax.numpy as jnp

    from bench.kernels import make_arrays, time_attention, workload_cost
    from jaxengine.runner.attention_backend import select_attention_backend

    dtype = jnp.bfloat16
    arrays = make_arrays(w, dtype, dense=False)
    cost = workload_cost(w, dtype)
    result: dict[str, Any] = {
        "tokens": int(sum(w.q_lens)),
        "requests": len(w.q_lens),
        "backend": select_attention_backend("auto").name,
    }
    result["reference"] = {"skipped": "temporaries too large (REFERENCE_MAX_BYTES)"}
    outputs = {}
    for name, attention in peers(w).items():
        fn = jax.jit(functools.partial(attention, sm_scale=arrays.sm_scale))
        try:
            timing = time_attention(fn, arrays.paged, cost, profile.iters)
            result[name] = rates(timing, denominators)
            outputs[name] = np.asarray(fn(*arrays.paged), np.float32)
        except Exception as exc:  # noqa: BLE001 - the reference may not fit: keep the engine's
            result[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    if len(outputs) == 2:
        result["max_err"] = float(np.abs(outputs["engine"] - outputs["reference"]).max())
        result["engine_over_reference"] = result["reference"]["us"] / result["engine"]["us"]
    return result


def rates(timing: Any, denominators: dict[str, float]) -> dict[str, float]:
    out = {
        "us": timing.seconds * 1e6,
        "gb_s": timing.bytes_per_s / 1e9,
        "tflop_s": timing.flops_per_s / 1e12,
    }
    if denominators.get("copy_gb_s"):
        out["of_copy"] = out["gb_s"] / denominators["copy_gb_s"]
    if denominators.get("matmul_tflop_s"):
        out["of_matmul"] = out["tflop_s"] / denominators["matmul_tflop_s"]
    return out


def run(section: Any, profile: Profile, denominators: dict[str, float]) -> None:
    """The three workloads' peers, then the block sweep (`bench.device.sweep`) in the
    time they left plus ``profile.sweep_s``."""
    from bench.device import sweep

    for w in workloads(profile):
        section.item(w.name, lambda w=w: measure(w, profile, denominators))
    section.budget_s += profile.sweep_s  # the sweep's own share, on top of the section's
    sweep.run(section, profile, denominators, workloads(profile))
