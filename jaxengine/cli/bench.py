"""`jaxengine bench {serve,throughput,latency}`: the packaged benchmarks under one command.

Each benchmark lives in `jaxengine.benchmarks` (``serve``, ``throughput``,
``latency``), so an installed package runs them, and is also runnable as
``python -m jaxengine.benchmarks.X``.
Every such module exposes ``add_cli_args(parser)`` and ``run(args, command)``, so the
flags and help here are the same as there. Those modules import only the standard
library at module level (numpy, jax, torch, httpx come when a benchmark runs), which
keeps ``jaxengine --help`` instant. The repository's ``bench/`` scripts are not
installed (pyproject's package list).
"""

from __future__ import annotations

import argparse
import importlib
import shlex
from functools import partial
from types import ModuleType

BENCHMARKS: dict[str, tuple[str, str]] = {
    "serve": (
        "jaxengine.benchmarks.serve",
        "online serving benchmark against a running API server",
    ),
    "throughput": (
        "jaxengine.benchmarks.throughput",
        "offline throughput of jaxengine and its peers",
    ),
    "latency": ("jaxengine.benchmarks.latency", "offline end-to-end latency of one batch"),
}
"""Sub-subcommand -> (module, one-line help)."""
_DISPATCH_KEYS = ("func", "subcommand", "bench_command", "argv")
"""Namespace entries of the command line itself, not of the benchmark."""


def register(subparsers) -> None:
    """Adds ``bench`` and its sub-subcommands."""
    parser = subparsers.add_parser(
        "bench",
        help="run a benchmark (serve, throughput, latency)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    benchmarks = parser.add_subparsers(title="benchmarks", dest="bench_command", metavar="")
    for name, (module_name, help_text) in BENCHMARKS.items():
        _register_benchmark(benchmarks, name, module_name, help_text)
    parser.set_defaults(func=partial(_print_help, parser))


def _register_benchmark(benchmarks, name: str, module_name: str, help_text: str) -> None:
    module = importlib.import_module(module_name)  # ships with jaxengine
    sub = benchmarks.add_parser(
        name,
        help=help_text,
        description=module.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.add_cli_args(sub)
    sub.set_defaults(func=partial(_run_benchmark, module))


def _run_benchmark(module: ModuleType, args: argparse.Namespace) -> int:
    """Runs ``module`` with its own arguments only (so that its JSON holds just those)."""
    own = {k: v for k, v in vars(args).items() if k not in _DISPATCH_KEYS}
    command = shlex.join(["jaxengine", *args.argv])
    return module.run(argparse.Namespace(**own), command)


def _print_help(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    parser.print_help()
    return 2
