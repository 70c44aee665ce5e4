"""The calls an RL trainer makes on its rollout engine, with vLLM's names.

`RolloutControl` drives one engine's replicas (one `LLMEngine`, or a data-parallel
engine's) between rollouts:

- ``sleep(level)`` / ``wake_up(tags)`` / ``is_sleeping()``: sleep mode
  (``enable_sleep_mode=True``; `runner.sleep`). The prefix cache is reset first: the
  KV pages it indexes are freed;
- ``update_weights(weights)``: ``(hf_name, array)`` pairs or a mapping, written into
  every replica (`runner.weights`), all or nothing; ``reload_weights(path)``: the
  checkpoint's (or another one's) tensors, the same way. Both reset the prefix cache,
  whose KV was computed with the old weights;
- ``reset_prefix_cache()``;
- ``collective_rpc(method, args, kwargs)``: any of the above by name (code written
  against vLLM's workers); one result per replica.

Each call needs an idle engine (no unfinished request): between `LLM.generate` calls,
or once `AsyncLLM.pause_generation` has drained or aborted the running ones; a weight
update may also come while paused with requests held (``mode="keep"``: they go on
with the new weights). While any part sleeps, a new request is refused with
`EngineSleepingError`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from jaxengine.config import EngineConfig


class EngineSleepingError(RuntimeError):
    """A request came while the engine sleeps (the server answers 503)."""


class Replica(Protocol):
    """What `RolloutControl` uses of one engine replica (`LLMEngine`)."""

    config: EngineConfig
    executor: Any
    scheduler: Any

    def has_unfinished_requests(self) -> bool: ...


RPC_METHODS = (
    "sleep",
    "wake_up",
    "is_sleeping",
    "update_weights",
    "reload_weights",
    "reset_prefix_cache",
)
"""What `collective_rpc` runs."""


class RolloutControl:
    """Sleep, wake and weight updates over ``replicas`` (every one the same model)."""

    def __init__(self, replicas: Sequence[Replica], reader: Callable[[str | None], Any]) -> None:
        """``reader(path)``: the checkpoint's ``(hf_name, array)`` pairs
        (`loader.checkpoint_tensors`)."""
        self.replicas = list(replicas)
        self.reader = reader
        self.paused = False
        """Set by `AsyncLLM.pause_generation`: unfinished requests are held, not
        stepped, and the weights may change under them (``mode="keep"``)."""

    @property
    def config(self) -> EngineConfig:
        return self.replicas[0].config

    def _idle(self, what: str, held_ok: bool = False) -> None:
        if held_ok and self.paused:
            return
        busy = [r for r in self.replicas if r.has_unfinished_requests()]
        if busy:
            raise RuntimeError(
                f"{what}: requests are still running; let them finish, abort them, or "
                "pause generation first"
            )

    def check_awake(self) -> None:
        """Raises `EngineSleepingError` while any replica sleeps (a new request)."""
        if self.is_sleeping():
            raise EngineSleepingError(
                "the engine is asleep (sleep mode): call wake_up() before generating"
            )

    def sleep(self, level: int = 1) -> None:
        if not self.config.model_config.enable_sleep_mode:
            raise ValueError(
                "sleep mode is off: start the engine with enable_sleep_mode=True "
                "(--enable-sleep-mode)"
            )
        if level not in (1, 2):
            raise ValueError(f"sleep level {level}: expected 1 or 2")
        self._idle("sleep")
        for replica in self.replicas:
            replica.scheduler.reset_prefix_cache()
            replica.executor.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        for replica in self.replicas:
            replica.executor.wake_up(tags)

    def is_sleeping(self) -> bool:
        return any(replica.executor.is_sleeping for replica in self.replicas)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix; False when some pages are in use (requests
        running), as vLLM's."""
        return all([replica.scheduler.reset_prefix_cache() for replica in self.replicas])

    def update_weights(self, weights: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> int:
        """Writes the tensors into every replica; returns the parameter leaves changed
        per replica. Raises `CheckpointError` naming a bad tensor (nothing changed)."""
        self._idle("update_weights", held_ok=True)
        pairs = list(weights.items() if isinstance(weights, Mapping) else weights)
        changed = 0
        for replica in self.replicas:
            changed = replica.executor.update_weights(pairs)
        self.reset_prefix_cache()
        return changed

    def reload_weights(self, path: str | None = None) -> int:
        """Reads the engine's checkpoint again, or the one at ``path`` (same
        architecture), into the running engine."""
        self._idle("reload_weights", held_ok=True)
        return self.update_weights(self.reader(path))

    def collective_rpc(
        self, method: str, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """``method`` of this class by name, once per replica's result (vLLM's shape)."""
        if method not in RPC_METHODS:
            raise ValueError(f"collective_rpc: unknown method {method!r}; expected one of "
                             f"{', '.join(RPC_METHODS)}")  # fmt: skip
        result = getattr(self, method)(*args, **(kwargs or {}))
        return [result] * len(self.replicas)
