"""Offline latency: one batch of B requests, end to end, timed over K iterations.

    python -m jaxengine.benchmarks.latency --batch-size 1 --input-len 16 --output-len 128

Each iteration submits B fresh random-token prompts (the same ones for every peer; a
new set each iteration, so no prefix or prompt cache can help) and waits until all
have ``output_len`` greedy tokens. Reported: the latency percentiles over the K timed
iterations (after W warm-up ones), and B * O / p50 latency, the tokens/s of that
batch, prefill included.

Decode alone is isolated by a second, interleaved series of iterations with
``output_len = 1`` (prefill plus the first token): with medians t(O) and t(1),

    decode tok/s = B * (O - 1) / (t(O) - t(1)),

the rate of the O - 1 decode steps, prompt processing excluded. With B = 1 and a
short prompt this is the headline "batch-1 decode tok/s". ``--no-isolate-decode``
skips the second series.

With ``--batch-size 1`` the run also measures the machine's float32 weight-streaming
roofline (`jaxengine.benchmarks.roofline`: a matrix-vector product over the model's weight bytes)
before the peers, and reports each peer's decode tok/s as a fraction of it
(``--no-roofline`` skips it). ``--roofline-dtypes float32,bfloat16,int8`` also times
the product with weights stored in those dtypes.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from statistics import median
from time import perf_counter

if __package__ in (None, ""):  # run as a file: python jaxengine/benchmarks/latency.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from jaxengine.benchmarks.common import (
    PERCENTILES,
    ModelFiles,
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
    non_negative_int,
    notes_cell,
    percentiles,
    positive_int,
    ratio,
    resolve_model_files,
    token_pool,
    write_json,
)
from jaxengine.benchmarks.peers import Peer, PeerOptions, run_peer
from jaxengine.benchmarks.roofline import Roofline

_FULL, _ONE = 1, 2  # seed tags of the two prompt series


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jaxengine.benchmarks.latency",
        description="End-to-end latency of one batch, for jaxengine and its peers.",
    )
    add_cli_args(parser)
    return parser


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Adds this benchmark's flags to ``parser`` (also used by ``jaxengine bench``)."""
    parser.add_argument("--batch-size", type=positive_int, default=1, help="requests per batch")
    add_common_args(parser)
    parser.set_defaults(input_len=16)
    parser.add_argument(
        "--num-iters-warmup", type=non_negative_int, default=1, help="untimed iterations"
    )
    parser.add_argument("--num-iters", type=positive_int, default=5, help="timed iterations")
    parser.add_argument(
        "--no-isolate-decode",
        action="store_true",
        help="skip the output-len=1 series that isolates decode speed",
    )
    parser.add_argument(
        "--no-roofline",
        action="store_true",
        help="skip measuring the float32 weight-streaming roofline (batch size 1 only)",
    )
    parser.add_argument(
        "--roofline-dtypes",
        type=lambda text: [d.strip() for d in text.split(",") if d.strip()],
        default=["float32"],
        help="weight dtypes whose matrix-vector product to time (float32, bfloat16, int8)",
    )


def batches(args: argparse.Namespace, pool, tag: int) -> list[list[list[int]]]:
    """One batch of fresh prompts per iteration (warm-up first), identical across peers."""
    total = args.num_iters_warmup + args.num_iters
    return [
        make_prompts(args.batch_size, args.input_len, pool, [args.seed, tag, k])
        for k in range(total)
    ]


def _timed(peer: Peer, prompts: list[list[int]], output_len: int) -> tuple[float, list]:
    start = perf_counter()
    outputs = peer.generate(prompts, output_len)
    return perf_counter() - start, outputs


def measure(
    peer: Peer,
    full: list[list[list[int]]],
    one: list[list[list[int]]] | None,
    args: argparse.Namespace,
) -> tuple[dict[str, float], list[str], list[list[int]]]:
    """Runs warm-up and timed iterations; returns (metrics, notes, last outputs).

    The output-len=1 iterations (``one``) interleave with the full ones, so that both
    series see the same machine noise.
    """
    batch, out_len, warmup = args.batch_size, args.output_len, args.num_iters_warmup
    times: list[float] = []
    times_one: list[float] = []
    outputs: list[list[int]] = []
    for k in range(len(full)):
        label = f"warm-up {k + 1}" if k < warmup else f"iteration {k - warmup + 1}"
        log(f"{peer.name}: {label}")
        t, outputs = _timed(peer, full[k], out_len)
        t_one = _timed(peer, one[k], 1)[0] if one is not None else None
        if k >= warmup:
            times.append(t)
            if t_one is not None:
                times_one.append(t_one)
    metrics = {f"latency_{k}_s": v for k, v in percentiles(times).items()}
    metrics["latency_avg_s"] = sum(times) / len(times)
    metrics["tokens_per_s"] = batch * out_len / median(times)
    if times_one:
        metrics["first_token_p50_s"] = median(times_one)
        decode_s = median(times) - median(times_one)
        if decode_s > 0:
            metrics["decode_tokens_per_s"] = batch * (out_len - 1) / decode_s
    log(f"{peer.name}: p50 {median(times):.3f} s, {metrics['tokens_per_s']:.1f} tok/s")
    notes = check_outputs(outputs, out_len)
    if not peer.batched and batch > 1:
        notes.append("sequential: no batched API")
    return metrics, notes, outputs


def render(results: list[PeerResult], roof: Roofline | None = None) -> str:
    header = ["backend", "load s", *(f"p{p} s" for p in PERCENTILES), "B*O/p50 tok/s"]
    header += ["prefill+1 s", "decode tok/s", "of roofline", "x transformers", "agree", "notes"]
    rows = []
    for r in results:
        m = r.metrics
        key = "decode_tokens_per_s" if "decode_tokens_per_s" in m else "tokens_per_s"
        rows.append(
            [
                r.backend,
                fmt(r.load_s, 1),
                *(fmt(m.get(f"latency_p{p}_s"), 3) for p in PERCENTILES),
                fmt(m.get("tokens_per_s"), 1),
                fmt(m.get("first_token_p50_s"), 3),
                fmt(m.get("decode_tokens_per_s"), 1),
                _of_roofline(m.get("decode_tokens_per_s"), roof),
                ratio(results, r, key),
                agreement_cell(results, r),
                notes_cell(r),
            ]
        )
    return format_table(header, rows)


def _of_roofline(tokens_per_s: float | None, roof: Roofline | None) -> str:
    if tokens_per_s is None or roof is None:
        return "-"
    return f"{100 * tokens_per_s / roof.tokens_per_s:.0f}%"


def measure_roofline(args: argparse.Namespace, files: ModelFiles) -> Roofline | None:
    """The float32 roofline (batch size 1 only), and each asked dtype's matvec time."""
    if args.no_roofline or args.batch_size != 1:
        return None
    from jaxengine.benchmarks import roofline

    roof = roofline.measure(files)
    log(
        f"roofline: float32 matvec over {roof.weight_bytes / 1e6:.0f} MB at "
        f"{roof.matvec_bytes_per_s / 1e9:.1f} GB/s = {roof.tokens_per_s:.1f} tok/s"
    )
    base = roof.weight_bytes / roof.matvec_bytes_per_s
    for dtype in args.roofline_dtypes:
        if dtype != "float32":
            seconds = roofline.matvec_seconds(roof.weight_bytes, dtype)
            slower = seconds / base
            log(f"roofline: {dtype} weights: {1e3 * seconds:.1f} ms ({slower:.2f}x float32)")
    return roof


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    argv_text = shlex.join(sys.argv[1:] if argv is None else argv)
    return run(args, f"python -m jaxengine.benchmarks.latency {argv_text}")


def run(args: argparse.Namespace, command: str) -> int:
    """Runs the benchmark for parsed ``args``; ``command`` is recorded in the JSON."""
    files = resolve_model_files(args.model)
    pool = token_pool(files)
    full = batches(args, pool, _FULL)
    isolate = not args.no_isolate_decode and args.output_len > 1
    one = batches(args, pool, _ONE) if isolate else None
    opts = PeerOptions(
        model=files,
        threads=args.threads,
        max_len=args.input_len + args.output_len,
        engine_kwargs=args.engine_kwargs,
        hf_batch_size=args.batch_size,
        llamacpp_n_batch=args.llamacpp_n_batch,
    )
    workload = {
        "model": args.model,
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_iters_warmup": args.num_iters_warmup,
        "num_iters": args.num_iters,
        "isolate_decode": isolate,
        "seed": args.seed,
        "threads": args.threads,
        "engine_kwargs": args.engine_kwargs,
    }
    machine = machine_info()  # before the runs: their start date
    roof = measure_roofline(args, files)
    results = [
        run_peer(name, opts, lambda p: measure(p, full, one, args)) for name in args.backends
    ]
    print(describe_run("offline latency", machine, workload))
    if roof is not None:
        print(
            f"float32 weight-streaming roofline (this run): {roof.weight_bytes / 1e6:.0f} MB of "
            f"weights at {roof.matvec_bytes_per_s / 1e9:.1f} GB/s = {roof.tokens_per_s:.1f} tok/s"
        )
    print(render(results, roof))
    print(
        "pNN = end-to-end latency of one batch; B*O/p50 = tokens/s of the batch, prefill "
        "included; prefill+1 = p50 latency with output-len 1; decode tok/s = "
        "B*(O-1)/(p50 - prefill+1); x transformers = ratio of decode tok/s (else B*O/p50)"
    )
    if args.json:
        if roof is not None:
            workload["roofline"] = roof.to_json()
        write_json(args.json, "latency", command, machine, workload, args, results)
    return 0 if any(r.status == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
