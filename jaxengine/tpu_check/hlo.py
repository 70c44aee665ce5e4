"""Reading a compiled program's optimized HLO text (``compiled.as_text()``): no JAX.

`parse` gives the module's computations as `Instruction`s with their result shapes,
each shape with its memory space (TPU: ``S(1)`` VMEM, ``S(2)`` SMEM, ``S(5)`` host; no
annotation: HBM), and their operands by name. `hbm_bytes` counts what the program's
instructions read from and write to HBM, by those memory spaces:

- every top-level instruction (not the insides of a fusion, which run in registers
  and VMEM) reads its operands that live in HBM and writes its results that do;
- an asynchronous ``*-start`` (a copy or slice into VMEM ahead of its use, or a
  collective) reads its operands and writes its destination, the first element of
  its result; its ``*-done`` moves nothing more;
- a ``gather`` reads the rows it gathers (its result), not its whole operand; a
  ``dynamic-update-slice`` or ``scatter`` writes its update in place (reads its
  indices and update, writes the update), also as the root of a fusion;
- a Pallas kernel (``tpu_custom_call``) is left out: what it moves depends on the
  request lengths at run time, and it declares its own bound (`report`); except the
  weights it takes (``weight_shapes``: the grouped matmul XLA lowers `ragged_dot`
  to on TPU takes the MoE experts), counted as read whole: an upper bound (a decode
  step's few tokens touch only some experts), so a step whose weights stream through
  a kernel is not taken for one that reads less than its weights; and the state pools
  it takes (``state_pools``: a hybrid model's delta-rule states, which the gated delta
  rule's TPU kernel reads and writes in place by row), counted as the bytes given for
  each (one read and one write of each request's row);
- loop bodies and called computations count once.

XLA's own ``cost_analysis()["bytes accessed"]`` counts every memory space alike (a
weight prefetched into VMEM is counted as read, written and read again: a
``[64, 4096] x [4096, 14336]`` matmul for v5e "accesses" five times its weight's
bytes), so it overstates the HBM traffic of a step whose weights stream through VMEM.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

_ITEMSIZE = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1,
    "s4": 1, "u4": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
    "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8,
}  # fmt: skip
_SHAPE = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\](\{[^{}]*(?:\([^)]*\)[^{}]*)*\})?")
_SPACE = re.compile(r"S\((\d+)\)")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$")
_CALLS = re.compile(r"\b(calls|body|condition|to_apply|branch_computations)=\{?%?([\w.\-%, ]+)\}?")
_NOTHING_MOVED = {
    "parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
    "partition-id", "replica-id", "copy-done", "slice-done", "all-gather-done",
    "all-reduce-done", "collective-permute-done", "send-done", "recv-done",
}  # fmt: skip
HBM = 0

Shape = tuple[str, tuple[int, ...]]  # (dtype, dims)


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One array of an instruction's result: its shape and memory space."""

    shape: Shape
    space: int  # 0: HBM (no annotation)

    @property
    def bytes(self) -> int:
        return shape_bytes(self.shape)


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    opcode: str
    results: tuple[Buffer, ...]
    operands: tuple[str, ...]  # operand names
    calls: tuple[str, ...]  # computations it calls (fusion, loop, call, reduce)
    text: str

    @property
    def custom_call_target(self) -> str | None:
        match = re.search(r'custom_call_target="([^"]*)"', self.text)
        return match.group(1) if match else None


@dataclasses.dataclass(frozen=True)
class Module:
    computations: dict[str, list[Instruction]]
    entry: str
    fused: frozenset[str]  # computations that are a fusion's insides

    by_name: dict[str, Instruction] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.by_name.update({i.name: i for body in self.computations.values() for i in body})

    def operand(self, name: str) -> Instruction | None:
        return self.by_name.get(name)

    def instructions(self) -> Iterator[Instruction]:
        for body in self.computations.values():
            yield from body


def shape_bytes(shape: Shape) -> int:
    dtype, dims = shape
    count = 1
    for d in dims:
        count *= d
    return count * _ITEMSIZE.get(dtype, 4)


def _buffers(text: str) -> tuple[Buffer, ...]:
    out = []
    for m in _SHAPE.finditer(text):
        if m.group(1) not in _ITEMSIZE:
            continue
        space = _SPACE.search(m.group(3) or "")
        dims = tuple(int(d) for d in m.group(2).split(",") if d)
        out.append(Buffer((m.group(1), dims), int(space.group(1)) if space else HBM))
    return tuple(out)


def _split_result(rest: str) -> tuple[str, str]:
    """(result type, the text after it) of the part after ``name = ``."""
    if not rest.startswith("("):
        head, _, tail = rest.partition(" ")
        return head, tail
    depth = 0
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return rest[: i + 1], rest[i + 1 :].lstrip()
    return rest, ""


def _instruction(line: str) -> Instruction | None:
    match = _INSTRUCTION.match(line)
    if not match:
        return None
    result, tail = _split_result(match.group(3))
    opcode, _, args = tail.partition("(")
    opcode = opcode.strip()
    if not opcode or " " in opcode:
        return None
    operands = tuple(re.findall(r"%([\w.\-]+)", args.split(")", 1)[0]))
    calls = tuple(
        name.strip().lstrip("%")
        for _, names in _CALLS.findall(tail)
        for name in names.split(",")
        if name.strip()
    )
    return Instruction(match.group(2), opcode, _buffers(result), operands, calls, line)


def parse(hlo: str) -> Module:
    """The module of an HLO text."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            current = computations.setdefault(head.group(2), [])
            entry = head.group(2) if head.group(1) else entry
            continue
        if current is not None and (ins := _instruction(line)) is not None:
            current.append(ins)
    fused = frozenset(
        name
        for body in computations.values()
        for ins in body
        if ins.opcode == "fusion"
        for name in ins.calls
    )
    return Module(computations, entry, fused)


def is_kernel(ins: Instruction) -> bool:
    """A Pallas TPU kernel (Mosaic custom call)."""
    return ins.opcode == "custom-call" and ins.custom_call_target == "tpu_custom_call"


def hbm_bytes(
    module: Module, weight_shapes: frozenset = frozenset(), state_pools: dict | None = None
) -> int:
    """Bytes the program's instructions move in HBM, Pallas kernels excepted but for
    their operands of ``weight_shapes`` (each a per-device weight's shape) and of
    ``state_pools`` (a pool's per-device shape -> the bytes a kernel moves in it)."""
    return sum(moved for _, moved in instruction_bytes(module, weight_shapes, state_pools))


def instruction_bytes(
    module: Module, weight_shapes: frozenset = frozenset(), state_pools: dict | None = None
) -> Iterator[tuple[Instruction, int]]:
    """``(instruction, bytes it moves in HBM)`` for every instruction `hbm_bytes`
    counts, the bodies of loops, calls and conditionals walked once each."""
    seen: set = set()
    pools = state_pools or {}

    def walk(name: str) -> Iterator[tuple[Instruction, int]]:
        if name in seen:
            return
        seen.add(name)
        for ins in module.computations.get(name, []):
            if ins.opcode in ("while", "call", "conditional"):
                for called in ins.calls:
                    yield from walk(called)
            elif is_kernel(ins):
                yield ins, _kernel_operand_bytes(module, ins, weight_shapes, pools)
            elif ins.opcode not in _NOTHING_MOVED:
                yield ins, _moved(module, ins)

    return walk(module.entry)


def _kernel_operand_bytes(module: Module, ins: Instruction, weights, pools: dict) -> int:
    """Bytes of the weights (shapes in ``weights``) a kernel takes from HBM, and what
    it moves in the state pools it takes (``pools``; each pool shape once)."""
    buffers = (_produced(op) for n in ins.operands if (op := module.operand(n)) is not None)
    shapes = [b.shape for bs in buffers for b in bs if b.space == HBM]
    return sum(shape_bytes(s) for s in shapes if s in weights) + sum(
        pools[s] for s in set(shapes) if s in pools
    )


def _hbm(buffers) -> int:
    return sum(b.bytes for b in buffers if b.space == HBM)


_PARTIAL_READS = ("gather", "slice", "dynamic-slice", "slice-start")


def _moved(module: Module, ins: Instruction) -> int:
    operands = [module.operand(n) for n in ins.operands]
    buffers = [_produced(op) for op in operands if op is not None]
    writes = list(ins.results)
    if ins.opcode.endswith("-start"):  # its result tuple repeats the operands
        for buf in (b for bs in buffers for b in bs):
            if buf in writes:
                writes.remove(buf)
    if ins.opcode in _PARTIAL_READS:  # reads what it takes, writes it where it goes
        taken = sum(b.bytes for b in writes if b.shape[1] and b.space != 2)
        return taken + _hbm(writes) + sum(_hbm(bs) for bs in buffers[1:])
    if ins.opcode in _UPDATE_OPERAND:  # in place: reads indices and update, writes it
        update = _UPDATE_OPERAND[ins.opcode]
        written = _hbm(buffers[update]) if len(buffers) > update else 0
        return sum(_hbm(bs) for bs in buffers[1:]) + written
    reads = [_fusion_read(module, ins, i, bs) for i, bs in enumerate(buffers)]
    in_place = _in_place_root(module, ins)
    if in_place is not None:  # the target operand is neither read nor rewritten whole
        target, update = in_place
        return sum(r for i, r in enumerate(reads) if i != target) + update
    return sum(reads) + _hbm(writes)


_UPDATE_OPERAND = {"dynamic-update-slice": 1, "scatter": 2}  # where the update comes in


def _in_place_root(module: Module, ins: Instruction) -> tuple[int, int] | None:
    """(operand index, update bytes) of a fusion whose root updates one of its
    parameters in place (a scatter or dynamic-update-slice into it); else None."""
    if ins.opcode != "fusion" or not ins.calls:
        return None
    body = module.computations.get(ins.calls[0], [])
    root = next((i for i in body if i.text.lstrip().startswith("ROOT")), None)
    if root is None or root.opcode not in _UPDATE_OPERAND or not root.operands:
        return None
    target = next((i for i in body if i.name == root.operands[0]), None)
    index = target and re.search(r"parameter\((\d+)\)", target.text)
    if target is None or target.opcode != "parameter" or not index:
        return None
    update = next((i for i in body if i.name == root.operands[_UPDATE_OPERAND[root.opcode]]), None)
    return int(index.group(1)), sum(b.bytes for b in update.results) if update else 0


def _produced(op: Instruction) -> tuple[Buffer, ...]:
    """The buffers an operand hands on: an async start's destination, else its result."""
    if op.opcode == "copy-start":
        return op.results[:1]
    if op.opcode.endswith("-start"):
        return op.results[1:2]
    return op.results


def _fusion_read(module: Module, ins: Instruction, index: int, buffers) -> int:
    """Bytes fusion ``ins`` reads of its operand ``index``: whole, unless inside the
    fusion that operand only feeds gathers or slices (then what they take)."""
    whole = _hbm(buffers)
    if ins.opcode != "fusion" or not whole or not ins.calls:
        return whole
    body = module.computations.get(ins.calls[0], [])
    param = next((i.name for i in body if i.opcode == "parameter"
                  and re.search(rf"parameter\({index}\)", i.text)), None)  # fmt: skip
    users = [i for i in body if param in i.operands]
    if not users or any(u.opcode not in _PARTIAL_READS or u.operands[0] != param for u in users):
        return whole
    return min(whole, sum(b.bytes for u in users for b in u.results))
