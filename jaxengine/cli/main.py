"""Entry point of the `jaxengine` console script: a parser with one subparser per module.

Subcommand modules are listed in SUBCOMMANDS and imported when the parser is built;
each exposes `register(subparsers)` (see `jaxengine.cli`). Nothing here imports jax,
so `jaxengine --help` and `jaxengine --version` return at once.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from jaxengine.config.arg_utils import FlexibleArgumentParser
from jaxengine.platforms import cpu_unless_a_tpu
from jaxengine.version import __version__

SUBCOMMANDS: list[str] = [
    # Module paths, each with `register(subparsers)`.
    # List only modules that exist: a missing one is an error, not skipped.
    "jaxengine.cli.serve",
    "jaxengine.cli.run_batch",
    "jaxengine.cli.generate",
    "jaxengine.cli.openai_clients",  # chat, complete
    "jaxengine.cli.bench",  # bench serve | throughput | latency
    "jaxengine.cli.collect_env",
    "jaxengine.cli.tpu_check",
]


def build_parser(subcommands: Sequence[str] | None = None) -> FlexibleArgumentParser:
    """The top-level parser, with the subcommands of `subcommands` (default SUBCOMMANDS)."""
    parser = FlexibleArgumentParser(
        prog="jaxengine",
        description="jaxengine: a vLLM-class LLM inference and serving engine in JAX.",
    )
    parser.add_argument("-v", "--version", action="version", version=__version__)
    subparsers = parser.add_subparsers(title="subcommands", dest="subcommand", metavar="")
    for module_name in SUBCOMMANDS if subcommands is None else subcommands:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parses `argv` (default sys.argv[1:]) and runs the chosen subcommand."""
    cpu_unless_a_tpu()  # before anything starts JAX (`jaxengine.platforms`)
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv  # the command line as given (`jaxengine bench` records it)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 0 if args.subcommand is None else 2
    result = func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
