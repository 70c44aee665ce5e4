"""Where one decode bucket's HBM traffic goes: a row of `bench.tpu_check` compiled for
its slice with only that bucket, and the bytes each instruction of the step's optimized
HLO moves (`jaxengine.tpu_check.hlo`, the count behind tpu-check's ratio), summed by
the operation that made it (its ``op_name``, every layer's under one ``L/`` name).

    python -m bench.tpu_hbm llama3-70b@v5p-8 --tokens 256            # the full model
    python -m bench.tpu_hbm llama3-70b@v5p-8 --tokens 256 --layers 2 # a quick look
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import tempfile

from bench.tpu_check import ROWS, at_depth


def step_hlo(name: str, tokens: int, layers: int | None, folder: str) -> str:
    """The optimized HLO of row ``name``'s decode step of ``tokens`` requests."""
    from jaxengine.engine_args import EngineArgs
    from jaxengine.tpu_check import recorder
    from jaxengine.tpu_check.check import check_engine

    config, topology, flags = ROWS[name]
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(at_depth(config, layers), f)
    tp = int(flags[flags.index("-tp") + 1]) if "-tp" in flags else 1
    args = EngineArgs(
        model=folder, tensor_parallel_size=tp, max_model_len=8192, max_num_seqs=tokens,
        max_num_batched_tokens=tokens, compile_token_buckets=[tokens],
        enable_expert_parallel="--enable-expert-parallel" in flags,
    )  # fmt: skip
    captured, record = [], recorder._record

    def keep(name, label, bucket, seconds, compiled, keep_hlo):
        out = record(name, label, bucket, seconds, compiled, keep_hlo)
        if bucket == (tokens, tokens) and out.hlo is not None:
            captured.append(out.hlo)
        return out

    recorder._record = keep
    try:
        check_engine(args, topology, progress=False)
    finally:
        recorder._record = record
    return captured[0]


def by_operation(text: str) -> list[tuple[int, int, str, str]]:
    """(bytes, instructions, opcode, operation) for every operation, most bytes first."""
    from jaxengine.tpu_check import hlo

    totals: dict = collections.defaultdict(lambda: [0, 0])
    for ins, moved in hlo.instruction_bytes(hlo.parse(text)):
        if hlo.is_kernel(ins):
            continue
        op = re.search(r'op_name="([^"]*)"', ins.text)
        key = re.sub(r".*layers_\d+/", "L/", op.group(1)) if op else ins.opcode
        entry = totals[(ins.opcode, key)]
        entry[0] += moved
        entry[1] += 1
    rows = [(b, n, opcode, key) for (opcode, key), (b, n) in totals.items()]
    return sorted(rows, reverse=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("row", choices=list(ROWS))
    parser.add_argument("--tokens", type=int, default=256, help="the decode bucket")
    parser.add_argument("--layers", type=int, default=None, help="the first N layers only")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    rows = by_operation(step_hlo(args.row, args.tokens, args.layers, tempfile.mkdtemp()))
    print(f"total {sum(r[0] for r in rows) / 1e6:,.1f} MB")
    for moved, count, opcode, key in rows[: args.top]:
        print(f"{moved / 1e6:10.1f} MB  x{count:<4d} {opcode:12s} {key[:90]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
