"""The compile check's store: compiles each program and keeps what XLA says of it.

`CompileRecorder` stands where a running engine has its `ExecutableStore`
(`runner.executables`): the stage program, the sampler and the other start-up
programs call ``compile(name, key, lower)`` on it. It times the lowering and the
compile, and keeps per program the per-device memory (`memory_analysis`: arguments,
outputs, aliased bytes, temporaries), XLA's cost (`cost_analysis`: flops, bytes
accessed) and, for the steps, the optimized HLO text that the audit reads. A compile
that fails raises `ProgramFailed`, naming the program and its bucket.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any


class ProgramFailed(RuntimeError):
    """A start-up program did not compile for the target."""

    def __init__(self, program: str, error: BaseException) -> None:
        self.program = program
        self.error = error
        super().__init__(f"{program}: {one_line(error)}")


def one_line(error: BaseException) -> str:
    """The first informative line of a compiler error (XLA's are long)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = " ".join(lines[:2]) if lines and lines[0].endswith(":") else (lines or [""])[0]
    return f"{type(error).__name__}: {text[:400]}"


@dataclasses.dataclass
class ProgramRecord:
    """One compiled program."""

    name: str  # "step", "prompt_logprobs", "sampler", "sampler.mask", "kv_amax", ...
    label: str  # the program and its shape, for people
    bucket: tuple[int, int] | None  # (tokens, requests) of a step, else None
    seconds: float  # lowering and compiling
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    flops: float
    bytes_accessed: float
    hlo: str | None = None  # the steps' optimized HLO (for the audit)

    @property
    def transient_bytes(self) -> int:
        """What the program adds on a device while it runs, besides its arguments:
        temporaries and the outputs that do not reuse an argument's buffer."""
        return self.temp_bytes + max(self.output_bytes - self.alias_bytes, 0)


class CompileRecorder:
    """A compile-only engine's store (`worker.target.CompileStore`)."""

    shareable = False  # every program compiles here, none taken from another engine

    def __init__(self, keep_hlo: tuple[str, ...] = ("step",)) -> None:
        self.records: list[ProgramRecord] = []
        self.keep_hlo = keep_hlo

    def compile(self, name: str, key: Any, lower) -> Any:
        bucket = step_bucket(key) if name == "step" else None
        label = _label(name, key, bucket)
        start = time.perf_counter()
        try:
            compiled = lower().compile()
        except Exception as error:  # noqa: BLE001 - every compiler error is reported alike
            raise ProgramFailed(label, error) from error
        seconds = time.perf_counter() - start
        self.records.append(_record(name, label, bucket, seconds, compiled, name in self.keep_hlo))
        return compiled


def _record(name, label, bucket, seconds, compiled, keep_hlo: bool) -> ProgramRecord:
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):  # older jax: one dict per computation
        cost = cost[0] if cost else {}
    return ProgramRecord(
        name=name,
        label=label,
        bucket=bucket,
        seconds=seconds,
        argument_bytes=int(getattr(memory, "argument_size_in_bytes", 0)),
        output_bytes=int(getattr(memory, "output_size_in_bytes", 0)),
        alias_bytes=int(getattr(memory, "alias_size_in_bytes", 0)),
        temp_bytes=int(getattr(memory, "temp_size_in_bytes", 0)),
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        hlo=compiled.as_text() if keep_hlo else None,
    )


def step_bucket(spec: Any) -> tuple[int, int]:
    """(tokens, requests) of a step's packed-input spec (`runner.step.step_inputs`:
    the token ids come first, the page table ``[R, M]`` is its one 2-D leaf)."""
    shapes = [shape for _, shape in spec.leaves]
    requests = next(shape[0] for shape in shapes if len(shape) == 2)
    return shapes[0][0], requests


def _label(name: str, key: Any, bucket: tuple[int, int] | None) -> str:
    if bucket is not None:
        return f"step ({bucket[0]} tokens, {bucket[1]} requests)"
    if name == "prompt_logprobs":
        return f"prompt logprobs ({key} tokens)"
    if name == "encoder":
        return f"image encoder ({key} units)"
    if name.startswith("sampler") and isinstance(key, tuple) and key:
        spec = key[0]
        rows = (
            getattr(spec, "leaves", [("", (None,))])[0][1][0] if hasattr(spec, "leaves") else key[0]
        )
        flags = key[1] if len(key) > 1 else ""
        return f"{name} ({rows} rows{', ' + _flags(flags) if flags else ''})"
    return name


def _flags(flags: Any) -> str:
    if not dataclasses.is_dataclass(flags):
        return str(flags)
    fields = {f.name: getattr(flags, f.name) for f in dataclasses.fields(flags)}
    return " ".join(
        f"{k}={v}" for k, v in fields.items() if v not in (False, 0, None, "raw_logprobs")
    )
