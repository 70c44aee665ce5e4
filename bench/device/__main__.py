"""One command that checks a GPU end to end: ``python -m bench.device``.

    python -m bench.device                       # on the GPU machine, about 8 minutes
    python -m bench.device --layers 8            # a cut model: faster engine section
    python -m bench.device --dry-run             # the same sections on CPU, tiny sizes
    python -m bench.device --sections kernels,engine --budget engine=400
    python -m bench.device --report device-2026-11-27-0930.json   # print a saved run

Runs the sections in order (environment, correctness, kernels, engine, peer), each within
its budget of seconds (`profile.GPU`, `profile.DRY_RUN`, ``--budget``): an item that
fails or runs out of time records its error and the run goes on. Everything goes to
``--output`` (default ``device-<date>.json`` in the current folder), saved after
every item; the tables (`report.tables`) are printed at the end.
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from bench.device import correctness, engine, environment, kernels, peer, report
from bench.device.engines import compilation_cache_restored
from bench.device.profile import DRY_RUN, GPU, SECTIONS, Profile
from bench.device.record import Recorder
from jaxengine.benchmarks.common import log, machine_info


def budget(text: str) -> tuple[str, float]:
    name, _, seconds = text.partition("=")
    if name not in SECTIONS or not seconds:
        raise argparse.ArgumentTypeError(f"expected SECTION=SECONDS, SECTION in {SECTIONS}")
    return name, float(seconds)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.device", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes, for a CPU")
    parser.add_argument("--output", type=Path, default=None, help="JSON file to write")
    parser.add_argument("--layers", type=int, default=None, help="cut the engine's model")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated")
    parser.add_argument("--budget", type=budget, action="append", default=[],
                        metavar="SECTION=SECONDS", help="a section's time budget")  # fmt: skip
    parser.add_argument("--report", type=Path, default=None, help="print a saved run")
    return parser


def run_sections(recorder: Recorder, profile: Profile, names: list[str], layers) -> None:
    denominators: dict[str, float] = {}
    for name in names:
        section = recorder.section(name, profile.budgets[name])
        try:
            with compilation_cache_restored():  # engines repoint JAX's cache: undone
                if name == "environment":
                    denominators = environment.run(section, profile, layers)
                elif name == "correctness":
                    correctness.run(section, profile)
                elif name == "kernels":
                    kernels.run(section, profile, denominators)
                elif name == "engine":
                    engine.run(section, profile, denominators, layers)
                else:  # the peer: its ratios divide the engine's figures of this run
                    peer.run(section, profile, layers, recorder.doc.get("engine", {}))
        except Exception as exc:  # noqa: BLE001 - a broken section must not end the run
            section.results["error"] = f"{type(exc).__name__}: {exc}"
        recorder.save()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.report is not None:
        import json

        print(report.tables(json.loads(args.report.read_text())))
        return 0
    names = [s for s in args.sections.split(",") if s]
    if unknown := set(names) - set(SECTIONS):
        raise SystemExit(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    profile = (DRY_RUN if args.dry_run else GPU).with_budgets(dict(args.budget))
    if not args.dry_run and no_accelerator():
        raise SystemExit("no GPU or TPU here: the full run is for one; use --dry-run on a CPU")
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d-%H%M")
    output = args.output or Path(f"device-{stamp}.json")
    argv_text = shlex.join(sys.argv[1:] if argv is None else argv)
    info: dict[str, Any] = {
        "command": f"python -m bench.device {argv_text}".strip(),
        "profile": profile.name,
        "layers": args.layers,
        "budgets": profile.budgets,
        "machine": machine_info(),
    }
    recorder = Recorder(output, info)
    start = time.perf_counter()
    run_sections(recorder, profile, names, args.layers)
    recorder.doc["run"]["seconds"] = round(time.perf_counter() - start, 1)
    recorder.save()
    print(report.tables(recorder.doc))
    log(f"results written to {output}")
    return 0


def no_accelerator() -> bool:
    import jax

    return jax.default_backend() == "cpu"


if __name__ == "__main__":
    sys.exit(main())
