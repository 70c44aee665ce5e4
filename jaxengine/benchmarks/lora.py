"""Multi-LoRA throughput: every request on a different adapter against the base model.

    jaxengine bench throughput --lora 4 --num-prompts 32 --input-len 64 --output-len 64

Two engines serve the random-token prompts of `jaxengine.benchmarks.throughput` greedily for exactly
``output_len`` tokens: the base model (no ``--enable-lora``), and an engine with
``--enable-lora --max-loras N --max-lora-rank R`` whose requests go round-robin over
N random rank-R adapters on every projection (written as PEFT folders here), so each
step mixes N adapters. The LoRA engine also runs the workload with no adapter (what
the slots cost when unused). Rounds alternate the engines so drift on a noisy machine
hits all of them; the ratios are per round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from time import perf_counter
from typing import Any

import numpy as np

from jaxengine.benchmarks.common import describe_run, fmt, format_table, log, machine_info


def write_adapters(root: Path, targets: dict, count: int, rank: int, seed: int) -> list[Path]:
    """``count`` random PEFT folders adapting every module of ``targets``."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    folders = []
    for i in range(count):
        folder = root / f"adapter{i}"
        folder.mkdir()
        tensors = {}
        for module, (out, inp) in targets.items():
            a = rng.standard_normal((rank, inp)) / np.sqrt(inp)
            b = rng.standard_normal((out, rank)) * 0.02
            tensors[f"base_model.model.{module}.lora_A.weight"] = a.astype(np.float32)
            tensors[f"base_model.model.{module}.lora_B.weight"] = b.astype(np.float32)
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "bias": "none"}
        (folder / "adapter_config.json").write_text(json.dumps(config))
        folders.append(folder)
    return folders


def timed(llm: Any, prompts: list[list[int]], params: Any, loras: list | None) -> float:
    requests = [{"prompt_token_ids": p} for p in prompts]
    start = perf_counter()
    outputs = llm.generate(requests, params, lora_request=loras, use_tqdm=False)
    elapsed = perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert tokens == len(prompts) * params.max_tokens, f"outputs stopped early ({tokens})"
    return elapsed


def run_lora(args: argparse.Namespace, files: Any, prompts: list[list[int]], command: str) -> int:
    from jaxengine import LLM, LoRARequest, SamplingParams
    from jaxengine.models.layers.lora import target_shapes

    n, rank = args.lora, args.lora_rank
    kwargs = {"max_model_len": max(map(len, prompts)) + args.output_len, **args.engine_kwargs}
    base = LLM(model=files.name, **kwargs)
    lora = LLM(model=files.name, enable_lora=True, max_loras=n, max_lora_rank=rank, **kwargs)
    with tempfile.TemporaryDirectory() as root:
        folders = write_adapters(Path(root), target_shapes(lora.engine.model_config), n, rank, 0)
        requests = [LoRARequest(f"adapter{i}", i + 1, str(f)) for i, f in enumerate(folders)]
        loras = [requests[i % n] for i in range(len(prompts))]
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        warm = SamplingParams(temperature=0, max_tokens=min(8, args.output_len), ignore_eos=True)
        log("warm-up: the whole batch, a few tokens, each engine")
        timed(base, prompts, warm, None)
        timed(lora, prompts, warm, loras)
        rounds = []
        for r in range(args.rounds):
            times = (
                timed(base, prompts, params, None),
                timed(lora, prompts, params, loras),
                timed(lora, prompts, params, None),
            )
            rounds.append(tuple(len(prompts) * args.output_len / t for t in times))
            log(
                f"round {r}: base, {n} adapters, no adapter: "
                + ", ".join(f"{x:.1f}" for x in rounds[-1])
            )
    compiles = lora.engine.executor.compiles_after_warmup
    base.shutdown()
    lora.shutdown()
    return report(args, command, rounds, compiles)


def report(args, command: str, rounds: list[tuple], compiles: int) -> int:
    workload = {
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "max_loras": args.lora,
        "max_lora_rank": args.lora_rank,
        "engine_kwargs": args.engine_kwargs,
        "rounds": args.rounds,
    }
    print(describe_run("multi-LoRA throughput", machine_info(), workload))
    rows = [
        [str(i), fmt(b, 1), fmt(m, 1), fmt(m / b, 3), fmt(u, 1), fmt(u / b, 3)]
        for i, (b, m, u) in enumerate(rounds)
    ]
    mixed = statistics.mean(m / b for b, m, _ in rounds)
    unused = statistics.mean(u / b for b, _, u in rounds)
    rows.append(["mean", "", "", fmt(mixed, 3), "", fmt(unused, 3)])
    header = ["round", "base out tok/s", f"{args.lora} adapters out tok/s", "ratio",
              "slots unused out tok/s", "ratio"]  # fmt: skip
    print(format_table(header, rows))
    print(f"compilations after warm-up in the LoRA engine: {compiles}")
    if args.json:
        doc = {"benchmark": "lora", "command": command, "machine": machine_info()}
        doc.update(workload=workload, rounds=rounds, ratio_mixed=mixed, ratio_unused=unused)
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0
