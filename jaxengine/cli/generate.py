"""`jaxengine generate PROMPT...`: one-shot offline generation through `LLM.generate`.

Greedy by default (``--temperature 0``); ``--chat`` wraps each prompt in the model's
chat template as a user message. Engine flags are the same as ``serve``'s, except
that ``--enforce-eager`` defaults to on: a one-shot run compiles only the buckets it
uses instead of all of them.
"""

from __future__ import annotations

import argparse
import dataclasses

from jaxengine.engine_args import EngineArgs


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate completions for prompts offline (default model: SmolLM2-135M-Instruct)",
        description=__doc__,
    )
    parser.add_argument("prompts", nargs="+", help="prompt texts")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="format each prompt as a chat user message (default: on)",
    )
    EngineArgs.add_cli_args(parser)
    # One-shot use: compile only the buckets this run touches (--no-enforce-eager to
    # compile every bucket up front, as `serve` does).
    parser.set_defaults(func=run, enforce_eager=True)


def run(args: argparse.Namespace) -> int:
    from jaxengine.entrypoints.llm import LLM
    from jaxengine.sampling_params import SamplingParams

    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**{f.name: getattr(engine_args, f.name) for f in dataclasses.fields(engine_args)})
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p
    )
    if args.chat:
        conversations = [[{"role": "user", "content": p}] for p in args.prompts]
        outputs = llm.chat(conversations, params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    for prompt, out in zip(args.prompts, outputs, strict=True):
        print(f"Prompt: {prompt!r}\nCompletion: {out.outputs[0].text!r}\n")
    return 0
