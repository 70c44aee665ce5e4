"""The `jaxengine` command line: `main.py` builds the parser from subcommand modules.

A subcommand module exposes `register(subparsers)`, adds its parser with
`subparsers.add_parser(name, ...)` (a FlexibleArgumentParser, so `--config` and
dotted JSON flags work), and sets `parser.set_defaults(func=run)` where
`run(args) -> int | None`. It must import heavy modules (jax, models) inside `run`,
not at module level, so that `jaxengine --help` stays fast.
"""

from jaxengine.config.arg_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
