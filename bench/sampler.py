"""The compiled sampler: one step of each precompiled variant, side by side.

    python -m bench.sampler                      # SmolLM2's vocabulary, 16 rows
    python -m bench.sampler --vocab 151936 --rows 64

Every variant an engine precompiles (`sampler_functions.sampler_variants`, without
the structured-output bitmask, which is a program of its own) samples the same
random logits; the table gives its milliseconds per step and the ratio to the variant
vLLM's default request runs (temperature 1, no top-k/top-p), and marks the variant
that `pick_variant` gives such a batch. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
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
from jaxengine.runner.sampling_metadata import SamplingBatch, SamplingRow, pick_variant
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    vocab, rows = args.vocab, args.rows
    row = SamplingRow(SamplingParams(temperature=1.0), [1, 2], [3, 4], seed=0)
    batch = SamplingBatch([row] * rows, rows, vocab)
    variants = sampler_variants(vocab, 20, "raw_logprobs", args.max_model_len)
    variants = [f for f in variants if not f.token_bitmask and not f.all_greedy]
    picked = pick_variant(batch.required_flags(), variants)
    logits = np.random.default_rng(0).standard_normal((rows, vocab)).astype(np.float32)
    times = {f: time_variant(f, batch, jax.numpy.asarray(logits), args.steps) for f in variants}
    workload = dict(vocab=vocab, rows=rows, steps=args.steps, batch="temperature 1 on every row")
    print(describe_run("sampler variants: one step each", machine_info(), workload))
    table = []
    for flags, (compiled, ms) in times.items():
        name = f"filter_width={flags.filter_width}, penalty_width={flags.penalty_width}"
        ratio = ms / times[picked][1]
        mark = "picked" if flags == picked else ""
        table.append([name, f"{compiled:.2f}", f"{ms:.1f}", f"{ratio:.2f}x", mark])
    print(format_table(["variant", "compile s", "ms/step", "vs picked", ""], table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
