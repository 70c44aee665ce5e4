"""Speculative decoding: decode tok/s with n-gram proposals against none, in one run.

    python -m bench.spec_decode --batch-sizes 1 32 --num-speculative-tokens 4

The workload is repetitive, where proposals from the request's own tokens pay: chat
prompts that ask the model to repeat, or to correct, a passage given in the prompt
(the passages below), decoded greedily until EOS or ``--output-len`` tokens. At each
batch size B, the engines serve the same B requests: none (no speculation), ngram
(``--speculative-config`` with ``num_speculative_tokens`` k), ngram with
``disable_by_batch_size`` (``--disable-by-batch-size``, proposals off while that many
requests run), and for each ``--draft-layers N`` a draft model: the model itself
cut to its first N layers (written here as a Hugging Face folder), proposing
greedily; and for each ``--eagle HEAD`` an EAGLE head (a folder in the EAGLE layout,
or ``random``: a random one-layer head, whose drafts are all but always rejected,
for what a head costs per step). Greedy outputs are the same with and without proposals (checked
here, as a sanity check); the figure is output tokens per second over the batch.
Rounds alternate the engines so drift on a noisy machine hits all of them; ratios
are per round. The acceptance rate and the mean acceptance length come from the
engines' own counters.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path
from time import perf_counter
from typing import Any

from jaxengine.benchmarks.common import (
    describe_run,
    fmt,
    format_table,
    log,
    machine_info,
    positive_int,
)

PASSAGES = [
    "The river rose slowly through the night, and by morning the lower road was under "
    "water. The farmers moved their animals to the hill behind the church, where the "
    "ground was dry, and waited for the rain to stop.",
    "To build the project, install the dependencies, run the configure script, and then "
    "call make from the top folder. The tests run with make check; each one prints its "
    "name and whether it passed.",
    "Our office will be closed on Monday for the holiday. Orders placed over the weekend "
    "will ship on Tuesday, and support tickets will be answered in the order they "
    "arrived.",
    "A good cup of tea starts with fresh water. Bring it to the boil, warm the pot, add "
    "one spoon of leaves for each cup, pour, and let it stand for four minutes before "
    "serving.",
]
ASKS = [
    "Repeat the following passage exactly, word for word:\n\n{}",
    "Correct any mistakes in this passage and write it out again in full:\n\n{}",
]


def chat_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    """``count`` prompts cycling over every (ask, passage) pair, chat-templated."""
    pairs = [(a, p) for a in ASKS for p in PASSAGES]
    prompts = []
    for i in range(count):
        ask, passage = pairs[i % len(pairs)]
        messages = [{"role": "user", "content": ask.format(passage)}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def timed(llm: Any, prompts: list[list[int]], params: Any) -> tuple[float, list, tuple]:
    """(output tok/s, outputs, (drafts, draft tokens, accepted) in the run)."""
    before = _spec(llm)
    requests = [{"prompt_token_ids": p} for p in prompts]
    start = perf_counter()
    outs = llm.generate(requests, params, use_tqdm=False)
    elapsed = perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    after = _spec(llm)
    spec = tuple(a - b for a, b in zip(after, before, strict=True))
    return sum(map(len, tokens)) / elapsed, tokens, spec


def _spec(llm: Any) -> tuple[int, int, int]:
    s = llm.engine.get_stats().spec_decoding
    return (0, 0, 0) if s is None else (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens)


def build_engines(args: argparse.Namespace, max_len: int) -> dict[str, Any]:
    from jaxengine import LLM

    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_min": args.prompt_lookup_min,
            "prompt_lookup_max": args.prompt_lookup_max}  # fmt: skip
    kwargs = {"max_model_len": max_len, "max_num_seqs": max(args.batch_sizes)}
    kwargs.update(args.engine_kwargs)
    limited = {**spec, "disable_by_batch_size": args.disable_by_batch_size}
    engines = {
        "none": LLM(model=args.model, **kwargs),
        "ngram": LLM(model=args.model, speculative_config=spec, **kwargs),
        "ngram+disable": LLM(model=args.model, speculative_config=limited, **kwargs),
    }
    for layers in args.draft_layers:
        draft = {"model": truncated_copy(args.model, layers),
                 "num_speculative_tokens": args.num_speculative_tokens}  # fmt: skip
        name = f"draft {layers} layers"
        engines[name] = LLM(model=args.model, speculative_config=draft, **kwargs)
    for head in args.eagle:
        folder = random_eagle_head(args.model) if head == "random" else head
        options = {"method": "eagle", "model": folder,
                   "num_speculative_tokens": args.num_speculative_tokens}  # fmt: skip
        engines[f"eagle {head}"] = LLM(model=args.model, speculative_config=options, **kwargs)
    return engines


def random_eagle_head(model: str) -> str:
    """A random one-layer EAGLE head for ``model`` in the EAGLE layout (the model's
    embedding shared), in a temporary folder: what a head costs when its drafts are
    rejected."""
    import tempfile

    import torch
    import transformers
    from safetensors.torch import save_file

    from jaxengine.benchmarks.common import resolve_model_files

    files = resolve_model_files(model)
    kwargs = {"gguf_file": files.gguf.name} if files.gguf is not None else {}
    config = transformers.AutoConfig.from_pretrained(files.folder, **kwargs)
    config.num_hidden_layers = 1
    config.__dict__.pop("quantization_config", None)
    head = transformers.LlamaModel(config)
    skip = ("norm.", "embed_tokens.", "layers.0.input_layernorm")
    tensors = {k: v for k, v in head.state_dict().items() if not k.startswith(skip)}
    width = config.hidden_size
    tensors["fc.weight"] = torch.randn(width, 2 * width) * 0.02
    folder = tempfile.mkdtemp(prefix="eagle-")
    save_file(tensors, f"{folder}/model.safetensors")
    config.save_pretrained(folder)
    return folder


def truncated_copy(model: str, num_layers: int) -> str:
    """The model's embeddings, first ``num_layers`` layers and norm as a Hugging Face
    folder (float32, in a temporary folder): a draft model of the same vocabulary."""
    import copy
    import tempfile

    import transformers

    from jaxengine.benchmarks.common import resolve_model_files

    files = resolve_model_files(model)
    if files.gguf is not None:
        kwargs = {"gguf_file": files.gguf.name}
    else:
        kwargs = {}
    full = transformers.AutoModelForCausalLM.from_pretrained(files.folder, **kwargs)
    config = copy.deepcopy(full.config)
    config.num_hidden_layers = num_layers
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    draft = transformers.AutoModelForCausalLM.from_config(config)
    keep = {f"layers.{i}." for i in range(num_layers)}
    state = {
        k: v
        for k, v in full.state_dict().items()
        if ".layers." not in k or any(tag in k for tag in keep)
    }
    draft.load_state_dict(state, strict=False)
    folder = tempfile.mkdtemp(prefix="draft-")
    draft.save_pretrained(folder)
    return folder


def run(args: argparse.Namespace, command: str) -> int:
    from jaxengine import SamplingParams

    engines = build_engines(args, 512)
    tokenizer = engines["none"].get_tokenizer()
    rows, doc = [], {}
    params = SamplingParams(temperature=0, max_tokens=args.output_len)
    for batch in args.batch_sizes:
        prompts = chat_prompts(tokenizer, batch)
        log(f"batch {batch}: warm-up")
        for llm in engines.values():
            timed(llm, prompts, SamplingParams(temperature=0, max_tokens=8))
        result = measure_batch(engines, prompts, params, args.rounds)
        doc[str(batch)] = result
        rows += table_rows(batch, result)
    compiles = {n: e.engine.executor.compiles_after_warmup for n, e in engines.items()}
    for llm in engines.values():
        llm.shutdown()
    report(args, command, rows, doc, compiles)
    return 0


def measure_batch(engines: dict, prompts: list, params: Any, rounds: int) -> dict:
    """Per engine: tok/s per round, and acceptance over all rounds."""
    speeds = {name: [] for name in engines}
    counts = {name: [0, 0, 0] for name in engines}
    reference = None
    for r in range(rounds):
        for name, llm in engines.items():
            speed, tokens, spec = timed(llm, prompts, params)
            reference = tokens if reference is None else reference
            same = tokens == reference
            speeds[name].append(speed)
            counts[name] = [a + b for a, b in zip(counts[name], spec, strict=True)]
            log(f"round {r} {name}: {speed:.1f} out tok/s, outputs identical: {same}")
            if not same:
                raise SystemExit(f"{name}: greedy outputs differ from the reference")
    return {"tok_s": speeds, "spec": counts}


def table_rows(batch: int, result: dict) -> list[list[str]]:
    base = result["tok_s"]["none"]
    rows = []
    for name, speeds in result["tok_s"].items():
        ratios = [s / b for s, b in zip(speeds, base, strict=True)]
        drafts, drafted, accepted = result["spec"][name]
        rate = f"{100 * accepted / drafted:.1f}%" if drafted else "-"
        length = fmt(1 + accepted / drafts, 2) if drafts else "-"
        rows.append([str(batch), name, fmt(statistics.mean(speeds), 1),
                     fmt(statistics.mean(ratios), 3), rate, length])  # fmt: skip
    return rows


def report(args, command: str, rows: list, doc: dict, compiles: dict) -> None:
    workload = {
        "model": args.model,
        "batch_sizes": args.batch_sizes,
        "output_len": args.output_len,
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup": [args.prompt_lookup_min, args.prompt_lookup_max],
        "disable_by_batch_size": args.disable_by_batch_size,
        "draft_layers": args.draft_layers,
        "rounds": args.rounds,
        "engine_kwargs": args.engine_kwargs,
    }
    print(describe_run("speculative decoding", machine_info(), workload))
    header = ["batch", "engine", "out tok/s", "ratio vs none", "acceptance", "mean accepted len"]
    print(format_table(header, rows))
    print(f"compilations after warm-up: {compiles}")
    if args.json:
        out = {"benchmark": "spec_decode", "command": command, "machine": machine_info()}
        out.update(workload=workload, results=doc)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 32])
    p.add_argument("--output-len", type=positive_int, default=128)
    p.add_argument("--num-speculative-tokens", type=positive_int, default=4)
    p.add_argument("--prompt-lookup-min", type=positive_int, default=2)
    p.add_argument("--prompt-lookup-max", type=positive_int, default=5)
    p.add_argument("--disable-by-batch-size", type=positive_int, default=8)
    p.add_argument("--draft-layers", type=positive_int, nargs="*", default=[],
                   help="also draft models: the model cut to its first N layers")  # fmt: skip
    p.add_argument("--eagle", nargs="*", default=[],
                   help="also EAGLE heads: folders in the EAGLE layout, or 'random' for a "
                   "random one-layer head (its cost when its drafts are rejected)")  # fmt: skip
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--engine-kwargs", type=json.loads, default={})
    p.add_argument("--json", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    argv_text = shlex.join(sys.argv[1:] if argv is None else argv)
    return run(args, f"python -m bench.spec_decode {argv_text}")


if __name__ == "__main__":
    sys.exit(main())
