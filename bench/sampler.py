"""The compiled sampler: one step of each precompiled random variant, side by side.

    python -m bench.sampler                      # SmolLM2's vocabulary, 16 rows
    python -m bench.sampler --vocab 151936 --rows 64

Every random variant an engine precompiles (`sampler_functions.sampler_variants`,
without the structured-output bitmask, which is a program of its own) samples the
same random logits for a batch of vLLM's default request (temperature 1, no
top-k/top-p), the variant `pick_variant` gives that batch again for the same batch
with one top-p row (the step that sorts), and, as the floor, a program compiled
without filters. The table gives milliseconds per step and the ratio to the picked
variant on the temperature-only batch. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import numpy as np

from jaxengine.benchmarks.common import describe_run, format_table, machine_info
from jaxengine.runner.sampler import sample_jit
from jaxengine.runner.sampler_functions import sampler_variants
from jaxengine.runner.sampling_metadata import (
    SamplerFlags,
    SamplingBatch,
    SamplingRow,
    pick_variant,
)
from jaxengine.sampling_params import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=49152, help="SmolLM2's by default")
    parser.add_argument("--rows", type=int, default=16, help="request slots per step")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--max-model-len", type=int, default=2048)
    return parser


def time_variant(flags, batch: SamplingBatch, logits, steps: int) -> tuple[float, float]:
    """(compile s, ms per step) of one variant on ``batch``."""
    metadata = batch.to_metadata(flags)
    start = time.perf_counter()
    jax.block_until_ready(sample_jit(logits, metadata, flags=flags))
    compiled = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        jax.block_until_ready(sample_jit(logits, metadata, flags=flags))
    return compiled, (time.perf_counter() - start) / steps * 1000


def runs(
    vocab: int, rows: int, max_model_len: int
) -> list[tuple[str, SamplerFlags, SamplingBatch]]:
    """(batch name, variant, batch) of each timed row; the first is the picked one."""
    plain = SamplingRow(SamplingParams(temperature=1.0), [1, 2], [3, 4], seed=0)
    nucleus = SamplingRow(SamplingParams(temperature=1.0, top_p=0.9), [1, 2], [3, 4], seed=1)
    batch = SamplingBatch([plain] * rows, rows, vocab)
    with_top_p = SamplingBatch([nucleus] + [plain] * (rows - 1), rows, vocab)
    variants = sampler_variants(vocab, 20, "raw_logprobs", max_model_len)
    variants = [f for f in variants if not f.token_bitmask and not f.all_greedy]
    picked = pick_variant(batch.required_flags(), variants)
    out = [("temperature 1", picked, batch), ("one row top_p 0.9", picked, with_top_p)]
    out += [("temperature 1", f, batch) for f in variants if f != picked]
    return out + [("temperature 1", dataclasses.replace(picked, filter_width=0), batch)]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    vocab, rows = args.vocab, args.rows
    logits = np.random.default_rng(0).standard_normal((rows, vocab)).astype(np.float32)
    logits = jax.numpy.asarray(logits)
    timed = [
        (name, flags, time_variant(flags, batch, logits, args.steps))
        for name, flags, batch in runs(vocab, rows, args.max_model_len)
    ]
    workload = dict(vocab=vocab, rows=rows, steps=args.steps)
    print(describe_run("sampler variants: one step each", machine_info(), workload))
    base = timed[0][2][1]
    table = [
        [
            f"filter_width={flags.filter_width}, penalty_width={flags.penalty_width}",
            name,
            f"{compiled:.2f}",
            f"{ms:.1f}",
            f"{ms / base:.2f}x",
            "picked" if i == 0 else "",
        ]
        for i, (name, flags, (compiled, ms)) in enumerate(timed)
    ]
    print(format_table(["variant", "batch", "compile s", "ms/step", "vs picked", ""], table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
