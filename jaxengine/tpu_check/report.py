"""What the compile check found: memory per chip, each program's cost, the audit.

`analyse` reads a compile-only engine and the `CompileRecorder`'s records into a
`CheckReport`:

- **per chip**: the parameters' bytes on one device (a vision-language model's image
  encoder's too, replicated), the KV cache sized from the chip's HBM at
  ``--gpu-memory-utilization`` (its tokens, and the concurrency at
  ``--max-model-len``), the rows of image embeddings the encoder writes
  (`runner.encoder`), the largest transient allocation (temporaries plus the outputs
  that reuse no argument, `ProgramRecord.transient_bytes`; the encoder's programs'
  too) and the program that needs it; it fits when these together are at most the
  chip's HBM;
- **per step bucket**: the bytes its instructions move in HBM outside the Pallas
  kernels, and the weights those kernels take (`hlo.hbm_bytes`, read from the
  compiled program's memory spaces: MoE experts in the grouped matmul), against
  the least a step must move: the weights it reads on this chip (`weights_read`: all
  but the input embedding's table, of which it gathers a few rows), its outputs and,
  in a hybrid model, one read and one write of each request's linear-attention states
  (`state_traffic`: inherent to the model, and also what the kernels that update the
  pools in place are counted as moving).
  ``bytes_over_minimum`` is their ratio; a copy of the cache or of a weight, or a
  weight gathered every step, shows there (and in the audit). Beside it, XLA's own
  ``bytes accessed`` (which counts VMEM traffic too) and the kernels' declared bound
  (attention: every request reads its whole page-table row; the lengths decide at
  run time);
- **decode tokens/s** the HBM traffic allows at batch 1 and 64 with ``CONTEXT``
  tokens of context each (the weights and XLA's traffic of the bucket, plus each
  request's KV at that length, at the chip's bandwidth);
- **the audit** (`audit.audit`) of every decode bucket.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from jaxengine.hardware import GiB, TpuSlice
from jaxengine.tpu_check import hlo
from jaxengine.tpu_check.audit import audit
from jaxengine.tpu_check.hlo import Shape
from jaxengine.tpu_check.recorder import ProgramRecord
from jaxengine.worker.target import device_bytes

CONTEXT = 1024  # tokens of context per request in the decode estimate (512 in + 512 out)
MAX_OVER_MINIMUM = 1.15  # what a decode step may move beyond the minimum

_HLO_DTYPES = {
    "bfloat16": "bf16", "float32": "f32", "float16": "f16", "int8": "s8", "uint8": "u8",
    "int32": "s32", "uint32": "u32", "float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2",
    "int4": "s4", "uint4": "u4",
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class StepTraffic:
    """One step bucket's HBM traffic on a chip."""

    tokens: int
    requests: int
    bytes_accessed: float  # XLA's cost analysis (every memory space, kernels declared)
    hbm_bytes: float  # what its instructions move in HBM, the kernels aside (`hlo`)
    kernel_bytes: float  # what the Pallas kernels declare (attention's upper bound)
    minimum_bytes: float  # the weights a step reads, on this chip, and its outputs
    bandwidth: float  # the chip's HBM bytes/s
    findings: tuple[str, ...]  # the audit's (decode buckets)
    kernels: int = 0  # Pallas TPU (Mosaic) kernel calls in the compiled step

    @property
    def decode(self) -> bool:
        return self.tokens == self.requests

    @property
    def bytes_over_minimum(self) -> float:
        return self.hbm_bytes / self.minimum_bytes

    @property
    def seconds_at_hbm(self) -> float:
        """The time its HBM traffic outside the kernels takes at the chip's bandwidth."""
        return self.hbm_bytes / self.bandwidth

    def to_json(self) -> dict:
        return {
            "tokens": self.tokens,
            "requests": self.requests,
            "kind": "decode" if self.decode else "prefill",
            "xla_bytes_accessed": self.bytes_accessed,
            "hbm_bytes": self.hbm_bytes,
            "kernel_bytes_declared": self.kernel_bytes,
            "minimum_bytes": self.minimum_bytes,
            "bytes_over_minimum": round(self.bytes_over_minimum, 4),
            "seconds_at_hbm": self.seconds_at_hbm,
            "pallas_kernel_calls": self.kernels,
            "audit": list(self.findings),
        }


@dataclasses.dataclass(frozen=True)
class CheckReport:
    """Everything ``jaxengine tpu-check`` prints and writes."""

    slice: TpuSlice
    model: str
    tensor_parallel_size: int
    params_bytes: int
    kv_bytes: int
    kv_tokens: int
    max_model_len: int
    largest_transient: tuple[str, int]
    programs: tuple[ProgramRecord, ...]
    steps: tuple[StepTraffic, ...]
    kv_bytes_per_token: float  # one chip's, all layers
    encoder_params_bytes: int = 0  # the image encoder's, on one chip (in params_bytes)
    image_rows_bytes: int = 0  # the image embeddings' rows on one chip (`runner.encoder`)

    @property
    def hbm_bytes(self) -> int:
        return self.slice.chip.hbm_bytes

    @property
    def needed_bytes(self) -> int:
        return self.params_bytes + self.kv_bytes + self.image_rows_bytes + self.largest_transient[1]

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.hbm_bytes

    @property
    def audit_findings(self) -> list[str]:
        return [f"{s.tokens}x{s.requests}: {f}" for s in self.steps if s.decode for f in s.findings]

    @property
    def worst_decode_ratio(self) -> float:
        return max((s.bytes_over_minimum for s in self.steps if s.decode), default=0.0)

    def decode_tokens_per_s(self, batch: int, context: int = CONTEXT) -> float | None:
        """Decode tokens/s the HBM traffic allows at ``batch`` requests of ``context``."""
        step = next((s for s in self.steps if s.decode and s.requests >= batch), None)
        if step is None:
            return None
        moved = step.hbm_bytes + batch * context * self.kv_bytes_per_token
        return batch / (moved / self.slice.chip.hbm_bandwidth)

    def to_json(self) -> dict:
        chip = self.slice.chip
        return {
            "topology": self.slice.name,
            "libtpu_topology": self.slice.topology,
            "chip": chip.name,
            "model": self.model,
            "tensor_parallel_size": self.tensor_parallel_size,
            "fits": self.fits,
            "per_chip": {
                "hbm_bytes": chip.hbm_bytes,
                "hbm_bandwidth": chip.hbm_bandwidth,
                "params_bytes": self.params_bytes,
                "encoder_params_bytes": self.encoder_params_bytes,
                "image_rows_bytes": self.image_rows_bytes,
                "kv_cache_bytes": self.kv_bytes,
                "kv_tokens": self.kv_tokens,
                "max_concurrency": self.kv_tokens / self.max_model_len,
                "max_model_len": self.max_model_len,
                "largest_transient_bytes": self.largest_transient[1],
                "largest_transient_program": self.largest_transient[0],
                "needed_bytes": self.needed_bytes,
            },
            "compile_seconds": sum(p.seconds for p in self.programs),
            "programs": [
                {
                    "program": p.label,
                    "seconds": round(p.seconds, 3),
                    "temp_bytes": p.temp_bytes,
                    "transient_bytes": p.transient_bytes,
                    "flops": p.flops,
                    "bytes_accessed": p.bytes_accessed,
                }
                for p in self.programs
            ],  # fmt: skip
            "steps": [s.to_json() for s in self.steps],
            "decode_tokens_per_s": {f"batch_{b}": self.decode_tokens_per_s(b) for b in (1, 64)},
            "decode_context": CONTEXT,
            "audit": self.audit_findings,
        }

    def lines(self) -> list[str]:
        """The summary printed for people."""
        chip, gib = self.slice.chip, lambda b: f"{b / GiB:.2f} GiB"
        name, size = self.largest_transient
        out = [
            f"{self.model} on {self.slice.name} ({self.slice.topology}, "
            f"TP {self.tensor_parallel_size}): {len(self.programs)} programs compiled in "
            f"{sum(p.seconds for p in self.programs):.1f} s",
            f"per chip: parameters {gib(self.params_bytes)}{self._image_parts()}, KV cache "
            f"{gib(self.kv_bytes)} ({self.kv_tokens} tokens, "
            f"{self.kv_tokens / self.max_model_len:.2f}x at max_model_len "
            f"{self.max_model_len}), largest transient {gib(size)} ({name}); "
            f"{gib(self.needed_bytes)} of {gib(chip.hbm_bytes)} HBM: "
            + ("fits" if self.fits else "DOES NOT FIT"),
        ]
        for s in self.steps:
            kind = "decode " if s.decode else "prefill"
            out.append(
                f"  {kind} {s.tokens:>5} tokens {s.requests:>4} requests: HBM "
                f"{s.hbm_bytes / GiB:.3f} GiB outside the kernels and in their weights = "
                f"{s.bytes_over_minimum:.3f}x the minimum ({s.seconds_at_hbm * 1e3:.2f} ms at "
                f"{chip.hbm_bandwidth / 1e12:.2f} TB/s); XLA's count {s.bytes_accessed / GiB:.3f} "
                f"GiB, the kernels' bound {s.kernel_bytes / GiB:.3f} GiB"
            )
        rates = [(b, self.decode_tokens_per_s(b)) for b in (1, 64)]
        out.append(
            "decode the HBM allows at "
            f"{CONTEXT} tokens of context: "
            + ", ".join(f"batch {b} {r:.0f} tok/s" for b, r in rates if r is not None)
        )
        findings = self.audit_findings
        out.append("audit: " + ("clean" if not findings else "; ".join(findings)))
        return out

    def _image_parts(self) -> str:
        """The image encoder's share of the parameters and its rows (if it has one)."""
        if not (self.encoder_params_bytes or self.image_rows_bytes):
            return ""
        return (
            f" (image encoder {self.encoder_params_bytes / GiB:.2f} GiB), image rows "
            f"{self.image_rows_bytes / GiB:.2f} GiB"
        )


def analyse(tpu: TpuSlice, runner: Any, host: Any, records: list) -> CheckReport:
    """The report of a compile-only engine (`check.check_engine`)."""
    model, config = host.model, host.config  # (max_model_len resolved)
    paged = _paged(runner.kv_caches)  # (a hybrid model's state pools aside)
    cache_shard = paged[0].sharding.shard_shape(paged[0].shape)
    encoder = runner.encoder  # a vision-language model's (`runner.encoder`), or None
    encoder_bytes = 0 if encoder is None else device_bytes(encoder.params)
    params_bytes = device_bytes(runner.params) + encoder_bytes
    per_token = host.kv_size.bytes_per_block / host.kv_size.block_size
    transients = [(p.label, p.transient_bytes) for p in records]
    steps = tuple(
        _traffic(p, tpu, model, cache_shard, runner) for p in records if p.bucket is not None
    )
    return CheckReport(
        slice=tpu,
        model=config.model_config.model,
        tensor_parallel_size=config.parallel_config.tensor_parallel_size,
        params_bytes=params_bytes,
        kv_bytes=host.kv_size.num_blocks * host.kv_size.bytes_per_block,
        kv_tokens=(host.kv_size.num_blocks - 1) * host.kv_size.block_size,
        max_model_len=config.model_config.max_model_len,
        largest_transient=max(transients, key=lambda t: t[1]),
        programs=tuple(records),
        steps=tuple(sorted(steps, key=lambda s: s.tokens)),
        kv_bytes_per_token=per_token,
        encoder_params_bytes=encoder_bytes,
        image_rows_bytes=0 if encoder is None else device_bytes(encoder.images),
    )


def weights_read(params: Any) -> int:
    """Bytes of ``params`` one device reads in a step: all but the tables a step only
    gathers a few rows of: the input embedding's when the model has its own LM head
    (a tied one reads it whole as the LM head), and per-layer input tables (Gemma 4's
    ``embed_tokens_per_layer``: 4 GB at its reference shape, of which a decode reads
    a row a token)."""
    tied = "lm_head" not in params
    embedding = {k: v for k, v in params.items() if k == "model"}
    gathered = [
        v
        for k, v in _flat(embedding)
        if "embed_tokens_per_layer" in k or ("embed_tokens" in k and not tied)
    ]
    return device_bytes(params) - device_bytes(gathered)


def _flat(tree: Any, prefix: str = ""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat(v, f"{prefix}/{k}")
    else:
        yield prefix, tree


def _traffic(record, tpu, model, cache_shard, runner) -> StepTraffic:
    tokens, requests = record.bucket
    module = hlo.parse(record.hlo or "")
    record.hlo = None  # read once: the text of a deep model's step is large
    outputs = max(record.output_bytes - record.alias_bytes, 0)
    shapes = _audit_shapes(runner.params, runner.kv_caches)
    findings = audit(module, *shapes) if tokens == requests else []
    pools = state_traffic(runner.kv_caches, requests)
    return StepTraffic(
        tokens=tokens,
        requests=requests,
        bytes_accessed=record.bytes_accessed,
        hbm_bytes=float(hlo.hbm_bytes(module, frozenset(shapes[1]), pools)),
        kernel_bytes=_kernel_bytes(model, tokens, requests, cache_shard, runner),
        minimum_bytes=float(
            weights_read(runner.params) + outputs + _state_bytes(runner.kv_caches, requests)
        ),
        bandwidth=tpu.chip.hbm_bandwidth,
        findings=tuple(str(f) for f in findings),
        kernels=sum(1 for i in module.instructions() if hlo.is_kernel(i)),
    )


def _kernel_bytes(model, tokens: int, requests: int, cache_shard: tuple, runner) -> float:
    """What the attention kernels (their own `cost.attention_cost`) and the cache
    writes declare to XLA for one step of every layer, on one device."""
    from pallas_kernels.ragged_paged_attention.cost import attention_cost

    _, page_size, two_hkv, head_dim = cache_shard
    shards = _paged(runner.kv_caches)[0].shape[2] // two_hkv  # tensor devices (rows padded)
    heads = model.num_heads // shards  # a device's query heads
    itemsize = np.dtype(runner.settings.cache_dtype).itemsize
    pages = runner.settings.pages_per_req
    read = attention_cost(
        (tokens, max(heads, 1), head_dim), cache_shard, (requests, pages), model.dtype
    ).bytes_accessed
    write = tokens * two_hkv * head_dim * itemsize * 2
    return float(len(_paged(runner.kv_caches)) * (read + write))


def state_traffic(caches: Any, requests: int) -> dict:
    """Per state pool's per-device shape (a hybrid model's linear-attention caches,
    `runner.states`): the bytes a step of ``requests`` requests moves in it, one read
    and one write of each request's row."""
    return {shape: 2 * requests * row for shape, row in _state_pools(caches)}


def _state_bytes(caches: Any, requests: int) -> int:
    """`state_traffic` summed over every pool of every layer."""
    return sum(2 * requests * row for _, row in _state_pools(caches))


def _state_pools(caches: Any) -> list[tuple[Shape, int]]:
    """(per-device shape, bytes of a row) of each state pool of ``caches``."""
    out = []
    for pool in (p for c in caches if isinstance(c, tuple) for p in c):
        dims = tuple(pool.sharding.shard_shape(pool.shape))
        out.append(((_hlo_dtype(pool.dtype), dims), int(np.prod(dims[1:])) * pool.dtype.itemsize))
    return out


def _paged(caches: Any) -> list:
    """The paged KV caches of ``caches`` (a linear-attention layer's entry is a tuple
    of state pools, `runner.states`)."""
    return [c for c in caches if not isinstance(c, tuple)]


def _audit_shapes(params: Any, caches: Any) -> tuple[set, set, set]:
    def shard(x) -> Shape:
        return (_hlo_dtype(x.dtype), tuple(x.sharding.shard_shape(x.shape)))

    import jax

    leaves = jax.tree_util.tree_leaves(params)
    return (
        {shard(c) for c in jax.tree_util.tree_leaves(caches)},
        {shard(w) for w in leaves if len(w.shape) >= 2},
        {(_hlo_dtype(w.dtype), tuple(w.shape)) for w in leaves if len(w.shape) >= 2},
    )


def _hlo_dtype(dtype: Any) -> str:
    name = np.dtype(dtype).name
    return _HLO_DTYPES.get(name, name)


def write_json(report: CheckReport, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report.to_json(), f, indent=2)
        f.write("\n")
