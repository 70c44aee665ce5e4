"""`Executor`: how an engine runs its model, wherever the devices are.

The engine core (scheduler, output processing) sees only this interface. An executor
is created with its model loaded, its KV cache sized and allocated
(`jaxengine.executor.create_executor`, which also returns the host parts: resolved
config, tokenizer, cache size, scheduler limits). Then:

- ``warmup(progress)`` compiles every step shape and arms the compile guards (with
  ``--background-compile``, a local executor returns at once and compiles beside
  its steps: `jaxengine.runner.warmup`);
- ``execute(scheduler_output)`` runs one scheduled step (including its page swaps)
  and returns the sampled ids and logprobs (`RunnerOutput`);
- ``submit(scheduler_output)`` dispatches one and returns a `StepResult` whose
  ``result()`` is that `RunnerOutput` (async scheduling: the engine schedules the
  next step before it asks). The local executor returns before the device is done;
  executors that drive other hosts run the step first (`DoneStep`). At most one
  submitted step may be unread when the next is submitted;
- ``add_lora(lora_request)`` reads and checks a LoRA adapter on the host (raises
  `LoRAAdapterError` when it cannot be served), ``remove_lora(lora_id)`` forgets one,
  ``list_loras()`` gives the registered ids (``--enable-lora``; without it, adding
  raises ValueError); ``pin_lora(lora_request)`` / ``unpin_lora(lora_id)`` keep an
  adapter's host copy while a request that uses it lives (the scheduler's
  `core.adapters.AdapterPins`: `lora.store`);
- ``sleep(level)`` frees the KV caches and parks (1) or drops (2) the weights,
  ``wake_up(tags)`` restores them, ``is_sleeping`` says whether any part is away and
  ``sleep_level`` at which level (0 awake; `runner.sleep`); ``update_weights(pairs)``
  writes ``(hf_name, array)`` pairs into the parameters, all or nothing
  (`runner.weights`). Executors that drive other hosts refuse them
  (NotImplementedError);
- ``check_health()`` raises when a worker is gone;
- ``compiles_after_warmup`` counts compilations that escaped warm-up (0 when none);
- ``shutdown()`` stops the workers and releases every device buffer. It is
  idempotent; the executor cannot run after it.

Implementations: `LocalExecutor` (this process's devices), `DriverExecutor` (this
host drives follower hosts over sockets, ``--nnodes`` > 1) and `RayExecutor`
(``--distributed-executor-backend ray``).
"""

from __future__ import annotations

from typing import Any, Protocol

from jaxengine.core.sched_output import RunnerOutput, SchedulerOutput


class StepResult(Protocol):
    def result(self) -> RunnerOutput: ...


class DoneStep:
    """A `StepResult` already computed."""

    def __init__(self, output: RunnerOutput) -> None:
        self.output = output

    def result(self) -> RunnerOutput:
        return self.output


class Executor(Protocol):
    def warmup(self, progress: bool = True) -> None: ...

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput: ...

    def submit(self, scheduler_output: SchedulerOutput) -> StepResult: ...

    def add_lora(self, lora_request: Any) -> bool: ...

    def remove_lora(self, lora_id: int) -> bool: ...

    def list_loras(self) -> set[int]: ...

    def pin_lora(self, lora_request: Any) -> None: ...

    def unpin_lora(self, lora_id: int) -> None: ...

    def sleep(self, level: int) -> None: ...

    def wake_up(self, tags: list[str] | None = None) -> None: ...

    @property
    def is_sleeping(self) -> bool: ...

    @property
    def sleep_level(self) -> int: ...

    def update_weights(self, weights: Any) -> int: ...

    def check_health(self) -> None: ...

    @property
    def compiles_after_warmup(self) -> int: ...

    def shutdown(self) -> None: ...


def refuse_rollout(where: str):
    """Sleep mode and weight updates on an executor that drives other hosts' workers:
    not there yet (each worker would have to sleep, wake and take its shards)."""

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"sleep mode and weight updates are not supported {where}")

    return refused
