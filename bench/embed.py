"""Embedding throughput: jaxengine's `LLM.embed` against transformers, in one run.

    python -m bench.embed --num-sentences 1000 --rounds 3

The workload is ``--num-sentences`` short sentences (5-20 words, made from a fixed
word list with a fixed seed). The peers embed all of them, one round after the
other, alternating so drift on a noisy machine hits both:

- jaxengine: ``LLM(model).embed(sentences)`` on the demo all-MiniLM-L6-v2 (the
  pooling runner; mean pooling and normalization from the model's
  sentence-transformers files), with ``--engine-kwargs`` (its ``--dtype auto`` is
  bfloat16 projections on a CPU with AMX-BF16, `config.model.auto_dtype`);
- sentence-transformers (when installed: ``pip install -e ".[bench]"``):
  ``SentenceTransformer(folder).encode(sentences)`` with its defaults (batches of
  ``--hf-batch-size``, 32, sorted by length), one peer per ``--st-dtypes`` entry
  (float32 by default; bfloat16 runs torch's AMX kernels);
- transformers: the same folder's ``AutoModel`` in float32, batches of
  ``--hf-batch-size`` in the given order, padded per batch, mean pooling over the
  attention mask and L2 normalization (sentence-transformers' arithmetic without its
  sorting by length).

The figure is sentences per second; each ratio is jaxengine's over a peer's, per
round. Every embedding is checked against the first float32 peer's (the lowest
cosine similarity of each peer is printed). After each round the machine's matmul
ceiling for the same sentences is measured (`bench.compute_ceiling`: the model's
projections timed in jaxengine's dtype; ``--no-ceiling`` skips it) and printed with
its ratio to each peer: the most an engine running those products could reach.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path
from time import perf_counter

import numpy as np

from bench import compute_ceiling
from jaxengine.benchmarks.common import (
    describe_run,
    fmt,
    format_table,
    log,
    machine_info,
    positive_int,
)

WORDS = (
    "the a river city small old new quick bright dark report market model team "
    "runs reads builds finds opens closes moves grows shows sells data water music "
    "night morning road house garden system train plan idea story price light "
    "after before under over with without near far today slowly quietly again"
).split()


def sentences(count: int, seed: int = 0) -> list[str]:
    rs = np.random.RandomState(seed)
    return [" ".join(rs.choice(WORDS, rs.randint(5, 21))).capitalize() + "." for _ in range(count)]


def hf_embedder(folder: str, batch_size: int):
    """transformers' mean-pooled, normalized embeddings in batches (float32)."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModel.from_pretrained(folder).eval()

    def embed(texts: list[str]) -> np.ndarray:
        out = []
        for i in range(0, len(texts), batch_size):
            batch = tokenizer(texts[i : i + batch_size], padding=True, return_tensors="pt")
            with torch.no_grad():
                hidden = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).float()
            mean = (hidden * mask).sum(1) / mask.sum(1)
            out.append(torch.nn.functional.normalize(mean, dim=-1).numpy())
        return np.concatenate(out)

    return embed


def st_embedder(folder: str, batch_size: int, dtype: str = "float32"):
    """sentence-transformers' own ``encode`` with the model in ``dtype`` (torch), or
    None when sentence-transformers is not installed."""
    try:
        import torch
        from sentence_transformers import SentenceTransformer
    except ImportError:
        log("sentence-transformers is not installed: that peer is left out")
        return None
    kwargs = {"torch_dtype": getattr(torch, dtype)}
    model = SentenceTransformer(folder, device="cpu", model_kwargs=kwargs)
    encode = lambda texts: model.encode(texts, batch_size=batch_size, convert_to_tensor=True)  # noqa: E731
    return lambda texts: encode(texts).float().numpy()


def run(args: argparse.Namespace, command: str) -> int:
    from jaxengine import LLM
    from jaxengine.loader.sources import resolve_model

    folder = str(resolve_model(args.model).path)
    texts = sentences(args.num_sentences)
    llm = LLM(args.model, **args.engine_kwargs)
    peers = {
        "jaxengine": lambda t: np.array(
            [o.outputs.embedding for o in llm.embed(t, use_tqdm=False)]
        ),
        **{
            "sentence-transformers" + ("" if d == "float32" else f" {d}"): st_embedder(
                folder, args.hf_batch_size, d
            )
            for d in args.st_dtypes
        },
        "transformers": hf_embedder(folder, args.hf_batch_size),
    }
    peers = {name: embed for name, embed in peers.items() if embed is not None}
    for embed in peers.values():  # warm-up
        embed(texts[:64])
    dtype = llm.engine.config.model_config.dtype
    meter = None if args.no_ceiling else ceiling_meter(folder, llm.get_tokenizer(), texts, dtype)
    ceilings: list[compute_ceiling.Ceiling] = []
    speeds: dict[str, list[float]] = {name: [] for name in peers}
    results: dict[str, np.ndarray] = {}
    for r in range(args.rounds):
        for name, embed in peers.items():
            start = perf_counter()
            results[name] = embed(texts)
            speeds[name].append(len(texts) / (perf_counter() - start))
            log(f"round {r} {name}: {speeds[name][-1]:.1f} sentences/s")
        if meter is not None:
            ceilings.append(meter())
            log(f"round {r} matmul ceiling: {ceilings[-1].sentences_per_s:.1f} sentences/s")
    reference = results["transformers"]
    cosines = {n: float(np.min(np.sum(r * reference, axis=1))) for n, r in results.items()}
    compiles = llm.engine.executor.compiles_after_warmup
    llm.shutdown()
    report(args, command, speeds, cosines, compiles, dtype, ceilings)
    return 0


CEILING_DTYPES = {"auto": "float32", "float32": "float32", "float": "float32",
                  "bfloat16": "bfloat16"}  # fmt: skip
"""The dtype of jaxengine's projections on CPU for each ``--dtype`` (`loader.cpu_dtypes`;
``auto`` here is what `config.model.auto_dtype` left: float32)."""


def ceiling_meter(folder: str, tokenizer, texts: list[str], dtype: str):
    """`compute_ceiling.ceiling_meter` for ``texts`` (counted by the engine's
    ``tokenizer``) on the model in ``folder``, or None (with a log line) where the model
    has no ``config.json`` or ``dtype`` no CPU mapping."""
    config_file = Path(folder) / "config.json"
    if dtype not in CEILING_DTYPES or not config_file.is_file():
        log(f"no matmul ceiling for --dtype {dtype} or a model without config.json")
        return None
    config = json.loads(config_file.read_text())
    counts = [len(ids) for ids in tokenizer(texts)["input_ids"]]
    return compute_ceiling.ceiling_meter(config, counts, CEILING_DTYPES[dtype])


def report(args, command, speeds, cosines, compiles: int, dtype: str, ceilings) -> None:
    workload = {"model": args.model, "num_sentences": args.num_sentences,
                "rounds": args.rounds, "hf_batch_size": args.hf_batch_size,
                "engine_kwargs": args.engine_kwargs}  # fmt: skip
    print(describe_run("embedding throughput", machine_info(), workload))
    ours = speeds["jaxengine"]
    rows = []
    for name, values in speeds.items():
        ratios = [o / v for o, v in zip(ours, values, strict=True)]
        rows.append([name, fmt(statistics.mean(values), 1), fmt(statistics.mean(ratios), 2),
                     f"{cosines[name]:.6f}"])  # fmt: skip
    print(format_table(["peer", "sentences/s", "jaxengine / peer", "lowest cosine"], rows))
    print(f"jaxengine --dtype: {dtype}; lowest cosine: against transformers' float32")
    print(f"compilations after warm-up: {compiles}")
    if ceilings:
        print(ceiling_line(ceilings, speeds))
    if args.json:
        out = {"benchmark": "embed", "command": command, "machine": machine_info(),
               "workload": workload, "results": speeds, "min_cosine": cosines,
               "jaxengine_dtype": dtype,
               "ceilings": [c.to_json() for c in ceilings]}  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


def ceiling_line(ceilings: list[compute_ceiling.Ceiling], speeds: dict[str, list[float]]) -> str:
    """The ceiling (one per round) and its ratio to each peer, per round then averaged,
    on one line."""
    per_round = [c.sentences_per_s for c in ceilings]
    ratios = ", ".join(
        f"{name} {statistics.mean(c / v for c, v in zip(per_round, values, strict=True)):.2f}x"
        for name, values in speeds.items()
    )
    first, rates = ceilings[0], [c.dot_flops_per_s / 1e9 for c in ceilings]
    return (
        f"matmul ceiling: {first.tokens:,} tokens x {first.flops_per_token / 1e6:.1f} MFLOP of "
        f"projections at {min(rates):.0f}-{max(rates):.0f} GFLOP/s ({first.dtype} dots, after "
        f"each round) = {statistics.mean(per_round):.1f} sentences/s; ceiling / peer: {ratios}"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="all-MiniLM-L6-v2")
    p.add_argument("--num-sentences", type=positive_int, default=1000)
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--hf-batch-size", type=positive_int, default=32)
    p.add_argument("--engine-kwargs", type=json.loads, default={})
    p.add_argument(
        "--st-dtypes",
        type=lambda s: s.split(","),
        default=["float32"],
        help="comma-separated torch dtypes of the sentence-transformers peers (float32, bfloat16)",
    )
    p.add_argument(
        "--no-ceiling", action="store_true", help="skip measuring the machine's matmul ceiling"
    )
    p.add_argument("--json", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    return run(args, "python -m bench.embed " + shlex.join(argv))


if __name__ == "__main__":
    raise SystemExit(main())
