"""Example custom logits processors for the tests (``--logits-processors``), importable
by qualified name (``tests.example_logits_processors:TargetTokenProcessor``).

`TargetTokenProcessor` is vLLM's ``DummyLogitsProcessor`` in JAX form: a request with
``extra_args={"target_token": t}`` can only sample ``t``; other requests are left
alone. `InvariantTargetProcessor` does the same for ``"invariant_target"`` but claims
to be argmax invariant, so the sampler runs it for random rows only (an all-greedy
batch skips it): a probe of where the sampler applies each kind.
`TorchStyleProcessor` has vLLM's torch form (``apply(logits)``) and must be refused.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxengine.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality


class TargetTokenProcessor(LogitsProcessor):
    """Rows whose request names a ``target_token`` keep only that token's logit."""

    key = "target_token"

    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        self.targets: dict[int, int] = {}  # batch index -> token
        self.updates: list[BatchUpdate] = []  # what update_state saw (for the tests)

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        target = (sampling_params.extra_args or {}).get(cls.key)
        if target is not None and (not isinstance(target, int) or target < 0):
            raise ValueError(f"{cls.key} must be a non-negative integer, got {target!r}")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        self.updates.append(batch_update)
        for index in batch_update.removed:
            self.targets.pop(index, None)
        for index, params, _, _ in batch_update.added:
            target = (params.extra_args or {}).get(self.key)
            if target is None:
                self.targets.pop(index, None)
            else:
                self.targets[index] = target
        for src, dst, how in batch_update.moved:
            a, b = self.targets.pop(src, None), self.targets.pop(dst, None)
            if a is not None:
                self.targets[dst] = a
            if b is not None and how == MoveDirectionality.SWAP:
                self.targets[src] = b

    def state(self, num_rows: int) -> np.ndarray:
        target = np.full(num_rows, -1, np.int32)  # [R], -1: the row is left alone
        for index, token in self.targets.items():
            if index < num_rows:
                target[index] = token
        return target

    def apply(self, logits, state):
        vocab = jnp.arange(logits.shape[-1])[None, :]  # [1, V]
        keep = (state[:, None] < 0) | (vocab == state[:, None])  # [R, V]
        return jnp.where(keep, logits, -jnp.inf)


class InvariantTargetProcessor(TargetTokenProcessor):
    """`TargetTokenProcessor` on ``invariant_target``, (falsely) argmax invariant."""

    key = "invariant_target"

    def is_argmax_invariant(self) -> bool:
        return True


class TorchStyleProcessor:
    """vLLM's torch interface: ``apply(logits)`` on a torch tensor, no state."""

    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: Any) -> None:
        pass

    def apply(self, logits):
        return logits
