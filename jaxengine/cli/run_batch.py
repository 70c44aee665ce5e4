"""`jaxengine run-batch -i in.jsonl -o out.jsonl`: an OpenAI batch file, offline.

Runs every request of the input file (``/v1/completions`` and
``/v1/chat/completions`` lines in OpenAI's batch format) through the engine at once
and writes one output line per input line, in order. A bad line becomes an error
line; it does not stop the run. ``-`` reads stdin / writes stdout. Engine flags are
``serve``'s; so are the frontend flags that shape responses.
"""

from __future__ import annotations

import argparse
import sys


def register(subparsers) -> None:
    from jaxengine.engine_args import EngineArgs
    from server.api_server.args import CONTENT_FORMATS, add_lora_args

    parser = subparsers.add_parser(
        "run-batch",
        help="run a file of OpenAI batch requests offline",
        description=__doc__,
    )
    add = parser.add_argument
    add("-i", "--input-file", required=True, help="batch input (JSONL), or - for stdin")
    add("-o", "--output-file", required=True, help="batch output (JSONL), or - for stdout")
    add("--response-role", default="assistant", help="the role of chat replies")
    add("--chat-template-content-format", choices=CONTENT_FORMATS, default="auto")
    add(
        "--trust-request-chat-template",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="render a line's own chat_template (refused without this flag)",
    )
    add("--return-tokens-as-token-ids", action="store_true")
    add("--enable-prompt-tokens-details", action="store_true")
    add("--max-log-len", type=int, default=None)
    add("--enable-log-requests", action="store_true")
    add_lora_args(add)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run, enable_force_include_usage=False)


def _read(path: str) -> list[str]:
    if path == "-":
        return sys.stdin.read().splitlines()
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


def _write(path: str, lines: list[str]) -> None:
    text = "".join(line + "\n" for line in lines)
    if path == "-":
        sys.stdout.write(text)
    else:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from tqdm import tqdm

    from jaxengine.engine_args import EngineArgs
    from jaxengine.entrypoints.factory import async_engine_from_args
    from server.api_server.app import server_options
    from server.batch.run_batch import run_batch
    from server.lora import check_lora_modules
    from server.serving import ServingContext

    try:
        lines = _read(args.input_file)
    except OSError as e:
        print(f"run-batch: cannot read {args.input_file}: {e}", file=sys.stderr)
        return 1
    check_lora_modules(args.lora_modules, args.enable_lora)
    engine = async_engine_from_args(EngineArgs.from_cli_args(args))
    try:
        ctx = ServingContext(engine, server_options(args, engine))
        count = sum(1 for line in lines if line.strip())

        async def with_adapters(bar):
            await ctx.models.add_static(args.lora_modules)  # a line's model may name one
            return await run_batch(ctx, lines, bar)

        with tqdm(total=count, desc="Running batch", disable=args.output_file == "-") as bar:
            records = asyncio.run(with_adapters(bar))
    finally:
        engine.shutdown()
    _write(args.output_file, [json.dumps(r, ensure_ascii=False) for r in records])
    failed = sum(1 for r in records if r["error"] or r["response"]["status_code"] != 200)
    print(
        f"run-batch: {len(records)} requests, {failed} failed -> {args.output_file}",
        file=sys.stderr,
    )
    return 0
