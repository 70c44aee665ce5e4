"""`LocalExecutor`: the engine's model on this process's devices."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxengine.core.sched_output import RunnerOutput, SchedulerOutput
from jaxengine.runner.encoder_weights import apply_encoder_tensors, split_encoder_tensors
from jaxengine.runner.model_runner import ModelRunner
from jaxengine.runner.pending import PendingStep
from jaxengine.runner.sleep import SleepMode, runner_parts
from jaxengine.runner.weights import apply_update, plan_update


class LocalExecutor:
    """One `ModelRunner` in this process (one replica's devices)."""

    def __init__(self, runner: ModelRunner, *, background_compile: bool = False) -> None:
        self.runner = runner
        self.background_compile = background_compile
        self.sleep_mode = SleepMode(runner_parts(runner))
        self.closed = False

    def warmup(self, progress: bool = True) -> None:
        self.runner.warmup(progress, background=self.background_compile)

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        self.check_health()
        return self.runner.execute(scheduler_output)

    def submit(self, scheduler_output: SchedulerOutput) -> PendingStep:
        self.check_health()
        return self.runner.launch(scheduler_output)

    def add_lora(self, lora_request) -> bool:
        return self._store().add(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._store().remove(lora_id)

    def list_loras(self) -> set[int]:
        return self._store().list()

    def pin_lora(self, lora_request) -> None:
        self._store().pin(lora_request)

    def unpin_lora(self, lora_id: int) -> None:
        self._store().unpin(lora_id)

    def _store(self):
        if self.runner.lora is None:
            raise ValueError("LoRA adapters need --enable-lora")
        return self.runner.lora.store

    def sleep(self, level: int) -> None:
        """Frees the KV caches and parks (1) or drops (2) the weights, between steps
        (`runner.sleep`)."""
        self.sleep_mode.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.sleep_mode.wake_up(tags)

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_mode.sleeping

    @property
    def sleep_level(self) -> int:
        return self.sleep_mode.level

    def update_weights(self, weights) -> int:
        """Writes ``(hf_name, array)`` pairs into the runner's parameters, all or
        nothing (`runner.weights`; an image encoder's tensors into its own,
        `runner.encoder_weights`); the number of leaves changed."""
        layout = self.runner.weights
        if layout is None:
            raise NotImplementedError("update_weights is not supported for this model")
        if self.sleep_mode.asleep("weights"):
            raise RuntimeError("the weights are asleep: wake_up(tags=['weights']) first")
        encoder, pairs = self.runner.encoder, weights
        if encoder is not None:  # its tensors are checked before any is written
            module = encoder.encoder.module
            mine, pairs = split_encoder_tensors(module, encoder.params, _pairs(weights))
        plan = plan_update(layout, pairs)
        self.runner.params = apply_update(self.runner.params, plan, layout)
        if encoder is not None:
            encoder.params = apply_encoder_tensors(encoder.params, mine)
            return len(plan) + len(mine)
        return len(plan)

    def check_health(self) -> None:
        if self.closed:
            raise RuntimeError("the executor is shut down")

    @property
    def compiles_after_warmup(self) -> int:
        return self.runner.compiles_after_warmup

    def shutdown(self) -> None:
        if not self.closed:
            self.closed = True
            self.runner.release()


def _pairs(weights: Any) -> list[tuple[str, Any]]:
    return list(weights.items() if isinstance(weights, Mapping) else weights)
