"""`TorchProgram`: the runner's `StageProgram` for a transformers PyTorch model.

The `ModelRunner` is the JAX path's own: the same request table, packing into one
flat batch, buckets, page swaps and the JAX sampler. Only the forward differs: each
step runs the PyTorch model eagerly (no compilation: buckets cost nothing here) on
the packed tokens with `attention.paged_attention` over torch KV pages, and hands
the sampled rows' logits to the sampler as a JAX array.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxengine.runner.batch import PackedBatch
from jaxengine.runner.sampler import prompt_logprobs_jit
from torch_fallback.attention import PagedStep, current

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PROMPT_LOGPROBS_ROWS = 256


class TorchProgram:
    """``params`` is the `torch.nn.Module` (a ``*ForCausalLM``); caches are a list of
    per-layer torch tensors ``[pages, page_size, 2 * Hkv, D]``."""

    def __init__(self, model: torch.nn.Module, k: int, device: torch.device) -> None:
        self.model = model
        self.k = k
        self.device = device
        self.softcap = getattr(model.config, "final_logit_softcapping", None)

    @property
    def logits_sharding(self) -> None:
        return None

    def place_params(self, params: Any) -> Any:
        return params

    def allocate_caches(self, shape: tuple, dtype: Any) -> list[torch.Tensor]:
        num_layers = self.model.config.num_hidden_layers
        torch_dtype = TORCH_DTYPES[np.dtype(dtype).name]
        return [
            torch.zeros(shape, dtype=torch_dtype, device=self.device) for _ in range(num_layers)
        ]

    def step(self, params: Any, caches: list, batch: PackedBatch, fed_ids: Any):
        """``(logits [R, V] as a JAX array, hidden [T, H] torch, caches)``; ``fed_ids``
        is not read (async scheduling is refused with this implementation)."""
        real = int(batch.query_start_loc[batch.num_seqs])  # the bucket's padding is skipped
        step = PagedStep.of(caches, batch, real, self.device)
        ids = torch.as_tensor(batch.token_ids[:real], dtype=torch.long, device=self.device)
        positions = torch.as_tensor(batch.positions[:real], dtype=torch.long, device=self.device)
        with torch.inference_mode(), current(step):
            out = params.base_model(
                input_ids=ids[None], position_ids=positions[None], use_cache=False
            )
            hidden = out.last_hidden_state[0]  # [real, H], after the final norm
            rows = torch.as_tensor(batch.logits_indices, dtype=torch.long, device=self.device)
            logits = self._logits(hidden[rows.clamp(max=max(real - 1, 0))])
        return jax.device_put(logits), hidden, caches

    def _logits(self, hidden: torch.Tensor) -> np.ndarray:
        logits = self.model.get_output_embeddings()(hidden).float()
        if self.softcap:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return logits.cpu().numpy()

    def prompt_logprobs(self, params: Any, hidden: torch.Tensor, targets: np.ndarray) -> Any:
        """Row ``t``'s logprob of ``targets[t]`` and top-``k``, ``PROMPT_LOGPROBS_ROWS``
        rows of logits at a time (the JAX sampler's `prompt_logprobs`). ``hidden`` has
        the step's real tokens; the bucket's padding rows past them come back zero."""
        if hidden.shape[0] < len(targets):
            hidden = torch.cat(
                [hidden, hidden.new_zeros(len(targets) - hidden.shape[0], hidden.shape[1])]
            )
        parts = []
        with torch.inference_mode():
            for start in range(0, hidden.shape[0], PROMPT_LOGPROBS_ROWS):
                rows = slice(start, start + PROMPT_LOGPROBS_ROWS)
                logits = jax.device_put(self._logits(hidden[rows]))
                wanted = jax.device_put(np.maximum(targets[rows], 0))
                parts.append(prompt_logprobs_jit(logits, wanted, self.k))
        return jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs), *parts)

    def precompile(self, params: Any, caches: Any, batch: PackedBatch, fed_ids: Any) -> None:
        """Nothing to compile: the model runs eagerly."""

    def kv_amax(self, params: Any, caches: Any, batch: PackedBatch, run: bool = True) -> Any:
        raise NotImplementedError(
            "--calculate-kv-scales is not supported with --model-impl transformers"
        )

    def gather(self, caches: list, ids: np.ndarray) -> list[np.ndarray]:
        # ids past the end are padding: read (clamped, as XLA's gather does), not used
        index = torch.as_tensor(np.asarray(ids), dtype=torch.long, device=self.device)
        index = index.clamp(max=caches[0].shape[0] - 1)
        return [cache[index].cpu().numpy() for cache in caches]

    def scatter(self, caches: list, ids: np.ndarray, pages: list[np.ndarray]) -> list:
        ids = np.asarray(ids)
        keep = ids < caches[0].shape[0]  # ids past the end are padding: dropped
        index = torch.as_tensor(ids[keep], dtype=torch.long, device=self.device)
        for cache, page in zip(caches, pages, strict=True):
            cache[index] = torch.as_tensor(np.asarray(page)[keep], device=self.device)
        return caches

    def micro_batches(self, num_tokens: list[int]) -> list[list[int]]:
        return [list(range(len(num_tokens)))]
