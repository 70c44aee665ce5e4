"""The audit of a compiled step: what a decode step must never do, read in its HLO.

A decode step should read each weight once and each request's KV pages once, write
the new K/V rows in place, and hand back the logits. `audit` reads the optimized HLO
text of a compiled program (``compiled.as_text()``) and returns one `Finding` for
each instruction that does one of these instead:

- **copies a whole KV cache** (a ``copy`` or ``copy-start`` whose result is a cache's
  per-device shape): the cache was not updated in place (a lost donation or alias,
  or a layout change);
- **copies a whole weight** (a copy of one of the program's parameters, with a
  weight's per-device shape, at least ``MIN_WEIGHT_BYTES``): a weight changes layout
  every step;
- **all-gathers a weight** under tensor parallelism (an ``all-gather`` whose operand
  is a weight's shard, or whose result is a whole weight): the sharding plan and the
  program disagree;
- **moves data to or from the host** (``send``/``recv``, ``infeed``/``outfeed``, a
  host callback, or a buffer in host memory space ``S(5)``).

Plain text in (`hlo.parse`), findings out: no JAX here, so the audit is checked on
programs made to fail it as well as on the engine's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from jaxengine.tpu_check.hlo import HBM, Instruction, Module, Shape, parse, shape_bytes

MIN_WEIGHT_BYTES = 1 << 20  # smaller weights (norms, biases) may be copied cheaply
HOST = 5  # the host's memory space in TPU layouts
_HOST_OPS = ("send", "recv", "infeed", "outfeed")


@dataclasses.dataclass(frozen=True)
class Finding:
    """One instruction the audit refuses."""

    rule: str  # "kv-cache copy", "weight copy", "weight all-gather", "host transfer"
    instruction: str  # its name in the HLO
    detail: str

    def __str__(self) -> str:
        return f"{self.rule}: {self.instruction} ({self.detail})"


def audit(
    hlo: str | Module,
    cache_shapes: Iterable[Shape],
    weight_shards: Iterable[Shape],
    weight_shapes: Iterable[Shape] = (),
) -> list[Finding]:
    """The findings in ``hlo`` (a compiled decode step's text, or its `hlo.parse`).
    ``cache_shapes``: the KV caches' per-device shapes; ``weight_shards``: each weight's
    per-device shape; ``weight_shapes``: each weight's whole shape (tensor
    parallelism). A copy into VMEM ahead of its use (XLA's prefetch of a weight, the
    one read the matmul needs) is no copy in HBM and passes."""
    module = parse(hlo) if isinstance(hlo, str) else hlo
    caches = set(cache_shapes)
    shards = {s for s in weight_shards if shape_bytes(s) >= MIN_WEIGHT_BYTES} - caches
    wholes = {s for s in weight_shapes if shape_bytes(s) >= MIN_WEIGHT_BYTES} - shards
    findings = []
    for ins in module.instructions():
        findings += _check(module, ins, caches, shards, wholes)
    return findings


def _check(module: Module, ins: Instruction, caches, shards, wholes) -> list[Finding]:
    out = []
    if ins.opcode in ("copy", "copy-start") and ins.results and ins.results[0].space == HBM:
        copied = ins.results[0].shape
        if copied in caches:
            out.append(Finding("kv-cache copy", ins.name, _fmt(copied)))
        elif copied in shards and _from_parameter(module, ins):
            out.append(Finding("weight copy", ins.name, _fmt(copied)))
    if ins.opcode in ("all-gather", "all-gather-start"):
        operands = [module.operand(n) for n in ins.operands]
        sources = [b.shape for op in operands if op is not None for b in op.results[:1]]
        gathered = [s for s in sources if s in shards]
        gathered += [b.shape for b in ins.results if b.shape in wholes]
        if gathered:
            out.append(Finding("weight all-gather", ins.name, _fmt(gathered[0])))
    host = any(b.space == HOST for b in ins.results)
    target = ins.custom_call_target or ""
    if (
        ins.opcode.split("-")[0] in _HOST_OPS
        or host
        or "host" in target.lower()
        or ("callback" in target.lower())
    ):
        out.append(Finding("host transfer", ins.name, ins.opcode))
    return out


def _from_parameter(module: Module, ins: Instruction) -> bool:
    """Whether ``ins`` copies a parameter of the program (a weight; an activation of
    the same shape is computed by the step)."""
    op = module.operand(ins.operands[0]) if ins.operands else None
    while op is not None and op.opcode in ("bitcast", "get-tuple-element") and op.operands:
        op = module.operand(op.operands[0])
    return op is not None and op.opcode == "parameter"


def _fmt(shape: Shape) -> str:
    dtype, dims = shape
    return f"{dtype}[{','.join(map(str, dims))}], {shape_bytes(shape) / (1 << 20):.1f} MiB"
