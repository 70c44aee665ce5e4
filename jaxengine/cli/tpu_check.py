"""`jaxengine tpu-check MODEL --topology v6e-8 [engine flags]`: compile for a TPU slice
on a machine without one, before renting it.

MODEL is a folder holding a ``config.json`` (no weights or tokenizer are read), a hub
id's folder, or a demo model. The engine is built as ``serve`` builds it on that slice
(the same flags: ``--tensor-parallel-size``, ``--max-model-len``,
``--gpu-memory-utilization``, ``--max-num-seqs``, ...) and every program it compiles
at start-up is compiled by libtpu for the slice's generation. It prints whether the
engine fits each chip (parameters, KV cache, the largest transient allocation), each
step bucket's HBM traffic against the least it must move, the decode rate that
traffic allows, and the audit of the decode steps; ``--output`` writes it all as
JSON. A failure is one line naming the program and bucket (a Mosaic VMEM overflow,
an HBM shortfall with its numbers) and exit status 1. Needs libtpu: the ``tpu``
extra (``pip install "jaxengine[tpu]"``).
"""

from __future__ import annotations

import argparse
import logging
import sys

from jaxengine.engine_args import EngineArgs


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "tpu-check",
        help="compile the engine for a TPU slice without one: fit, cost and audit",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="a folder with config.json, or a demo model (overrides --model)",
    )
    parser.add_argument(
        "--topology",
        required=True,
        help="the TPU slice: Cloud's name (v5e-4, v6e-8, v5p-8, v4-8) or libtpu's (v6e:2x4)",
    )
    parser.add_argument("--output", default=None, help="write the report as JSON to this file")
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar while compiling"
    )
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from jaxengine.tpu_check.check import CheckFailed, check_engine
    from jaxengine.tpu_check.recorder import one_line
    from jaxengine.tpu_check.report import write_json

    if args.model_tag:
        args.model = args.model_tag
    engine_args = EngineArgs.from_cli_args(args)
    try:
        report = check_engine(engine_args, args.topology, progress=not args.no_progress)
    except CheckFailed as error:
        print(f"tpu-check: FAILED: {error}", file=sys.stderr)
        return 1
    except Exception as error:  # noqa: BLE001 - one line for people; the trace in the log
        logging.getLogger(__name__).debug("tpu-check failed", exc_info=True)
        print(f"tpu-check: FAILED: {args.topology}: {one_line(error)}", file=sys.stderr)
        return 1
    for line in report.lines():
        print(line)
    if args.output:
        write_json(report, args.output)
    if not report.fits:
        print(
            f"tpu-check: FAILED: {report.model} needs "
            f"{report.needed_bytes / (1 << 30):.2f} GiB of each {report.slice.chip.name} "
            f"chip's {report.hbm_bytes / (1 << 30):.2f} GiB",
            file=sys.stderr,
        )
        return 1
    return 0
