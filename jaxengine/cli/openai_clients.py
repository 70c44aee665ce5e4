"""`jaxengine chat` and `jaxengine complete`: talk to a running OpenAI-compatible server.

Both are vLLM's client subcommands: ``--url`` (default ``http://localhost:8000/v1``),
``--model-name`` (default: the first model of ``GET /v1/models``), ``--api-key``
(default: ``$OPENAI_API_KEY``, else ``$JAXENGINE_API_KEY``, else ``EMPTY``) and
``-q/--quick TEXT`` for one request whose reply is printed before exiting.

Without ``--quick`` they read lines from stdin (prompt ``> ``) until EOF and stream each
reply to stdout as it arrives. ``chat`` keeps the conversation (with ``--system-prompt``
first); ``complete`` sends each line as an independent prompt. ``--quick`` waits for the
whole reply (no streaming), as in vLLM. Informational lines ("Using model: ...") go to
stderr, so stdout holds only the replies.

An unreachable server ends the command with one line on stderr and exit status 1. An
error answer (HTTP 4xx/5xx) does too with ``--quick``; in interactive mode it is
reported and the session goes on (the failed message is not kept in the history).
The ``openai`` package is imported when the command runs, not when the parser is built.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

DEFAULT_URL = "http://localhost:8000/v1"
API_KEY_ENV_VARS = ("OPENAI_API_KEY", "JAXENGINE_API_KEY")


def register(subparsers) -> None:
    """Adds the ``chat`` and ``complete`` subcommands."""
    chat = subparsers.add_parser(
        "chat",
        help="chat with a running API server (interactive, or one message with --quick)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_query_args(chat)
    chat.add_argument(
        "--system-prompt", default=None, help="system message put first in the conversation"
    )
    chat.add_argument(
        "-q", "--quick", metavar="MESSAGE", default=None, help="send one message, print the reply"
    )
    chat.set_defaults(func=run_chat)

    complete = subparsers.add_parser(
        "complete",
        help="complete prompts through a running API server (interactive, or --quick)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_query_args(complete)
    complete.add_argument(
        "-q",
        "--quick",
        metavar="PROMPT",
        default=None,
        help="send one prompt, print the completion",
    )
    complete.set_defaults(func=run_complete)


def _add_query_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", default=DEFAULT_URL, help="base URL of the API server (default: %(default)s)"
    )
    parser.add_argument(
        "--model-name",
        default=None,
        help="model to use (default: the first model the server lists at /v1/models)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="API key (default: $OPENAI_API_KEY, else $JAXENGINE_API_KEY, else 'EMPTY')",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="tokens per reply (default: the server's)"
    )


def default_api_key() -> str:
    """The key from the environment (see API_KEY_ENV_VARS), or ``"EMPTY"``."""
    for name in API_KEY_ENV_VARS:
        if os.environ.get(name):
            return os.environ[name]
    return "EMPTY"


def run_chat(args: argparse.Namespace) -> int:
    """``jaxengine chat``: returns the exit status."""
    return _run(args, _chat_session)


def run_complete(args: argparse.Namespace) -> int:
    """``jaxengine complete``: returns the exit status."""
    return _run(args, _complete_session)


Session = Callable[[Any, str, argparse.Namespace], None]


def _run(args: argparse.Namespace, session: Session) -> int:
    """Connects, picks the model and runs ``session``; turns failures into one line."""
    import openai

    client = openai.OpenAI(
        base_url=args.url, api_key=args.api_key or default_api_key(), max_retries=0
    )
    try:
        model = args.model_name or _first_model(client)
        if args.quick is None:
            print(f"Using model: {model}", file=sys.stderr)
        session(client, model, args)
    except openai.APIConnectionError as e:
        return _fail(f"cannot reach the server at {args.url}: {_reason(e)}")
    except openai.APIStatusError as e:
        return _fail(_status_message(e))
    except openai.OpenAIError as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 0


def _first_model(client: Any) -> str:
    import openai

    models = client.models.list().data
    if not models:
        raise openai.OpenAIError("the server lists no models; pass --model-name")
    return models[0].id


def _chat_session(client: Any, model: str, args: argparse.Namespace) -> None:
    messages: list[dict[str, str]] = []
    if args.system_prompt:
        messages.append({"role": "system", "content": args.system_prompt})
    options = _options(args)
    if args.quick is not None:
        messages.append({"role": "user", "content": args.quick})
        reply = client.chat.completions.create(model=model, messages=messages, **options)
        print(reply.choices[0].message.content or "")
        return
    for line in _read_lines():
        messages.append({"role": "user", "content": line})
        create = partial(client.chat.completions.create, model=model, messages=messages)
        stream = _create_or_report(partial(create, stream=True, **options))
        text = None if stream is None else _print_stream(stream, _chat_delta)
        if text is None:
            messages.pop()  # the server refused it: do not keep it in the history
        else:
            messages.append({"role": "assistant", "content": text})


def _complete_session(client: Any, model: str, args: argparse.Namespace) -> None:
    options = _options(args)
    if args.quick is not None:
        reply = client.completions.create(model=model, prompt=args.quick, **options)
        print(reply.choices[0].text)
        return
    for line in _read_lines():
        create = partial(client.completions.create, model=model, prompt=line)
        stream = _create_or_report(partial(create, stream=True, **options))
        if stream is not None:
            _print_stream(stream, _completion_delta)


def _options(args: argparse.Namespace) -> dict[str, Any]:
    return {} if args.max_tokens is None else {"max_tokens": args.max_tokens}


def _read_lines() -> Iterator[str]:
    """Non-empty lines typed after a ``> `` prompt, until EOF."""
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return
        if line.strip():
            yield line


def _create_or_report(create: Callable[[], Any]) -> Any:
    """``create()``, or None after printing the server's error answer (session goes on)."""
    import openai

    try:
        return create()
    except openai.APIStatusError as e:
        print(f"error: {_status_message(e)}", file=sys.stderr, flush=True)
        return None


def _print_stream(stream: Any, delta: Callable[[Any], str | None]) -> str:
    """Prints each chunk's text as it arrives; returns the whole reply."""
    parts: list[str] = []
    for chunk in stream:
        text = delta(chunk) if chunk.choices else None
        if text:
            print(text, end="", flush=True)
            parts.append(text)
    print(flush=True)
    return "".join(parts)


def _chat_delta(chunk: Any) -> str | None:
    return chunk.choices[0].delta.content


def _completion_delta(chunk: Any) -> str | None:
    return chunk.choices[0].text


def _status_message(e: Any) -> str:
    body = e.body if isinstance(e.body, dict) else {}
    detail = body.get("message") or body.get("error") or e.message
    if isinstance(detail, dict):
        detail = detail.get("message", detail)
    return f"the server answered HTTP {e.status_code}: {detail}"


def _reason(e: BaseException) -> str:
    """The innermost cause's message (e.g. 'Connection refused'), not the wrapper's."""
    while e.__cause__ is not None:
        e = e.__cause__
    return str(e) or type(e).__name__


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return 1
