"""Offline throughput: N requests submitted at once, finished as fast as the peer can.

    python -m jaxengine.benchmarks.throughput --num-prompts 64 --input-len 128 --output-len 128

With ``--structured-outputs``, jaxengine alone serves the workload free and under
a JSON schema per request (`jaxengine/benchmarks/structured.py`).

Each peer gets the same N random-token prompts and generates exactly ``output_len``
greedy tokens for each (EOS ignored). The figures are over the wall time of the one
``generate`` call that serves all N: output tokens/s (the headline), requests/s and
total (prompt + output) tokens/s. Model loading and a short warm-up (a few prompts,
a few tokens) come before the clock starts; load time is shown apart. jaxengine and
transformers batch the requests; llama-cpp-python has no batched API, so it serves
them one after another (said in the table).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from time import perf_counter

if __package__ in (None, ""):  # run as a file: python jaxengine/benchmarks/throughput.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from jaxengine.benchmarks.common import (
    PeerResult,
    add_common_args,
    agreement_cell,
    check_outputs,
    describe_run,
    fmt,
    format_table,
    log,
    machine_info,
    make_prompts,
    notes_cell,
    positive_int,
    ratio,
    resolve_model_files,
    token_pool,
    write_json,
)
from jaxengine.benchmarks.peers import Peer, PeerOptions, run_peer

WARMUP_PROMPTS = 4
WARMUP_TOKENS = 4


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jaxengine.benchmarks.throughput",
        description="Offline throughput of jaxengine and its peers on one random workload.",
    )
    add_cli_args(parser)
    return parser


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Adds this benchmark's flags to ``parser`` (also used by ``jaxengine bench``)."""
    parser.add_argument("--num-prompts", type=positive_int, default=64, help="requests")
    add_common_args(parser)
    parser.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="vary prompt lengths uniformly in input-len * [1 - r, 1 + r] (default: 0, "
        "all prompts input-len long)",
    )
    parser.add_argument(
        "--hf-batch-size",
        type=positive_int,
        default=None,
        help="prompts per transformers generate() call (default: all in one batch)",
    )
    parser.add_argument(
        "--no-warmup", action="store_true", help="skip the short warm-up before timing"
    )
    parser.add_argument(
        "--structured-outputs",
        action="store_true",
        help="jaxengine alone, the workload free and under one JSON schema per request, "
        "alternated for --rounds rounds: the ratio, and schema compile times "
        "(jaxengine/benchmarks/structured.py)",
    )
    parser.add_argument(
        "--lora",
        type=positive_int,
        default=None,
        metavar="N",
        help="jaxengine alone: the base model against an engine with --max-loras N whose "
        "requests go round-robin over N random adapters, alternated for --rounds rounds "
        "(jaxengine/benchmarks/lora.py)",
    )
    parser.add_argument(
        "--lora-rank", type=positive_int, default=16, help="rank of the --lora adapters"
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=2,
        help="rounds of --structured-outputs or --lora",
    )


def measure(
    peer: Peer, prompts: list[list[int]], output_len: int, warmup: bool
) -> tuple[dict[str, float], list[str], list[list[int]]]:
    """Times one generate() over all prompts; returns (metrics, notes, outputs)."""
    if warmup:
        log(f"{peer.name}: warm-up")
        peer.generate(prompts[:WARMUP_PROMPTS], min(output_len, WARMUP_TOKENS))
    log(f"{peer.name}: {len(prompts)} requests")
    start = perf_counter()
    outputs = peer.generate(prompts, output_len)
    elapsed = perf_counter() - start
    n_in = sum(len(p) for p in prompts)
    n_out = sum(len(o) for o in outputs)
    metrics = {
        "elapsed_s": elapsed,
        "requests_per_s": len(prompts) / elapsed,
        "output_tokens_per_s": n_out / elapsed,
        "total_tokens_per_s": (n_in + n_out) / elapsed,
        "prompt_tokens": n_in,
        "output_tokens": n_out,
    }
    notes = check_outputs(outputs, output_len)
    if not peer.batched:
        notes.append("sequential: no batched API")
    log(f"{peer.name}: {elapsed:.1f} s, {n_out / elapsed:.1f} output tok/s")
    return metrics, notes, outputs


def render(results: list[PeerResult]) -> str:
    header = ["backend", "load s", "time s", "req/s", "out tok/s", "total tok/s"]
    header += ["x transformers", "agree", "notes"]
    rows = []
    for r in results:
        m = r.metrics
        rows.append(
            [
                r.backend,
                fmt(r.load_s, 1),
                fmt(m.get("elapsed_s")),
                fmt(m.get("requests_per_s")),
                fmt(m.get("output_tokens_per_s"), 1),
                fmt(m.get("total_tokens_per_s"), 1),
                ratio(results, r, "output_tokens_per_s"),
                agreement_cell(results, r),
                notes_cell(r),
            ]
        )
    return format_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    argv_text = shlex.join(sys.argv[1:] if argv is None else argv)
    return run(args, f"python -m jaxengine.benchmarks.throughput {argv_text}")


def run(args: argparse.Namespace, command: str) -> int:
    """Runs the benchmark for parsed ``args``; ``command`` is recorded in the JSON."""
    files = resolve_model_files(args.model)
    prompts = make_prompts(
        args.num_prompts, args.input_len, token_pool(files), args.seed, args.range_ratio
    )
    if args.structured_outputs:
        from jaxengine.benchmarks.structured import run_structured

        return run_structured(args, files, prompts, command)
    if args.lora:
        from jaxengine.benchmarks.lora import run_lora

        return run_lora(args, files, prompts, command)
    opts = PeerOptions(
        model=files,
        threads=args.threads,
        max_len=max(len(p) for p in prompts) + args.output_len,
        engine_kwargs=args.engine_kwargs,
        hf_batch_size=args.hf_batch_size,
        llamacpp_n_batch=args.llamacpp_n_batch,
    )
    workload = {
        "model": args.model,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "range_ratio": args.range_ratio,
        "output_len": args.output_len,
        "seed": args.seed,
        "threads": args.threads,
        "hf_batch_size": args.hf_batch_size or args.num_prompts,
        "engine_kwargs": args.engine_kwargs,
    }
    machine = machine_info()  # before the runs: their start date
    results = [
        run_peer(
            name, opts, lambda peer: measure(peer, prompts, args.output_len, not args.no_warmup)
        )
        for name in args.backends
    ]
    print(describe_run("offline throughput", machine, workload))
    print(render(results))
    print(
        "out tok/s = output tokens / wall time of one generate() over all requests; "
        "x transformers = out tok/s ratio; agree = greedy tokens shared with transformers"
    )
    if args.json:
        write_json(args.json, "throughput", command, machine, workload, args, results)
    return 0 if any(r.status == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
