"""The sizes of a run: `GPU` (the real check, about 8 minutes on an H100) and
`DRY_RUN` (the same sections on CPU with a tiny model, so the script cannot rot
between GPU windows). Host code: no JAX here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

SECTIONS = ("environment", "correctness", "kernels", "engine", "peer")


@dataclass(frozen=True)
class EngineShape:
    """The scheduler and compilation arguments of one kind of engine."""

    max_num_seqs: int
    max_num_batched_tokens: int
    buckets: tuple[int, ...]
    """``compile_token_buckets``: few, since every engine compiles each of them."""
    num_blocks: int | None = None
    """``num_gpu_blocks_override``; None: the engine sizes its KV cache from memory."""

    def kwargs(self) -> dict:
        out = {
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "compile_token_buckets": list(self.buckets),
        }
        if self.num_blocks is not None:
            out["num_gpu_blocks_override"] = self.num_blocks
        return out


@dataclass(frozen=True)
class Profile:
    """Every size a run uses; `GPU` and `DRY_RUN` below are the two in use."""

    name: str
    small_model: bool
    """A tiny Llama (`bench.decode_roofline.llama_config(small=True)`) instead of
    Llama-3-8B's shapes in the engine section."""
    copy_mib: int
    """Size of the copy-bandwidth probe (an elementwise pass, read + write)."""
    read_mib: int
    """Size of the read-bandwidth probe (a float32 sum over a bf16 array)."""
    matmul_tokens: int
    """Rows of the bf16 matmul probe (one Llama layer's projections)."""
    iters: int
    """Timed calls per kernel and matmul measurement."""
    pytest_timeout_s: float
    family_tokens: int
    """Greedy tokens per prompt on the tiny Llama, Qwen3 and Gemma 3 models."""
    prompt_len: int
    """Prompt of the batch-1 decode measurements."""
    decode_tokens: int
    trace_decode_steps: int
    """Batch-1 decode steps in the engine section's profiler trace (after one prefill)."""
    repeats: int
    """Repeats of each batch-1 generation (the median is taken)."""
    throughput: tuple[int, int, int]
    """(prompts, input tokens, output tokens) of the offline throughput."""
    ttft_len: int
    spec: tuple[int, int]
    """(prompt tokens, output tokens) of the n-gram speculation at batch 1."""
    lora: tuple[int, int, int, int, int]
    """(adapters, rank, prompts, input tokens, output tokens)."""
    small: EngineShape
    """Engines of the batch-1 and variant measurements."""
    big: EngineShape
    """The engine of the throughput and TTFT measurements (may equal ``small``: then
    one engine serves both)."""
    eager_variants: bool
    """Variant engines (sync, quantized, fp8 cache, n-gram, LoRA) and the tiny
    families skip the warm-up and compile what they use (``enforce_eager``): the dry
    run's compile time, halved. The GPU run warms every engine up."""
    peer_device: str
    """torch's device for the transformers peer (`bench.device.peer`)."""
    budgets: dict[str, float] = field(default_factory=dict)
    """Seconds per section."""
    sweep_s: float = 0.0
    """Seconds the kernels section adds to its budget for its block sweep
    (`bench.device.sweep`); the sweep also gets whatever its other items left."""

    def with_budgets(self, overrides: dict[str, float]) -> Profile:
        return dataclasses.replace(self, budgets={**self.budgets, **overrides})


GPU = Profile(
    name="gpu",
    small_model=False,
    copy_mib=1024,
    read_mib=3072,  # 1.5 G elements: below 2^31, so 32-bit indexing suffices
    matmul_tokens=8192,
    iters=20,
    pytest_timeout_s=140,
    family_tokens=16,
    prompt_len=128,
    decode_tokens=128,
    trace_decode_steps=8,
    repeats=3,
    throughput=(256, 1024, 128),
    ttft_len=2048,
    spec=(64, 128),
    lora=(4, 16, 8, 128, 64),
    small=EngineShape(8, 256, (8, 256), num_blocks=1024),
    big=EngineShape(256, 2048, (256, 2048)),
    eager_variants=False,
    peer_device="cuda",
    # the sections' caps sum to 570 s, under the device's 600 s a command: the last
    # run (2026-11-28) used 245 s of them before the trace, the peer and the sweep
    budgets={"environment": 30, "correctness": 120, "kernels": 40, "engine": 230, "peer": 90},
    sweep_s=60,  # about 20-40 configs at 1-3 s each (a Triton compile, 21 calls of ~1 ms)
)

DRY_RUN = Profile(
    name="dry-run",
    small_model=True,
    copy_mib=8,
    read_mib=8,
    matmul_tokens=64,
    iters=2,
    pytest_timeout_s=120,
    family_tokens=8,
    prompt_len=16,
    decode_tokens=8,
    trace_decode_steps=4,
    repeats=1,
    throughput=(8, 24, 8),
    ttft_len=48,
    spec=(24, 16),
    lora=(4, 8, 4, 16, 8),
    small=EngineShape(8, 64, (64,), num_blocks=128),
    big=EngineShape(8, 64, (64,), num_blocks=128),
    eager_variants=True,
    peer_device="cpu",
    budgets={"environment": 120, "correctness": 300, "kernels": 120, "engine": 600, "peer": 120},
    sweep_s=30,  # an upper bound: 2 x 3 configs in interpret mode take about 10 s
)
