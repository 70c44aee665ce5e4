"""Real models at full depth compiled for the TPU slices they are served on.

Each row writes the model's ``config.json`` (published dimensions; no weights are
needed) and runs ``jaxengine tpu-check`` on it as a user would, with the flags of the
row, in its own process. The table gives: fits, KV tokens per replica, the start-up
compile time on this machine, the decode step's HBM traffic outside the kernels over
the least it must move, and the decode rate that traffic allows at batch 1 and 64
(1,024 tokens of context each), beside sglang-jax's published v6e-4 Llama-3.1-8B
figure (1,449 output tok/s at 16 concurrent 512/512 requests, TPOT 9.9 ms).

    python -m bench.tpu_check                      # every row (tens of minutes)
    python -m bench.tpu_check --rows llama3-8b@v6e-8 --output /tmp/tpu
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
    torch_dtype="bfloat16",
)  # fmt: skip
LLAMA3_70B = dict(
    LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
    num_attention_heads=64,
)  # fmt: skip
QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
    hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
    num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, max_position_embeddings=40960, norm_topk_prob=True,
    rope_theta=1000000.0, torch_dtype="bfloat16",
)  # fmt: skip
GEMMA3_27B = dict(
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262208,
    hidden_size=5376, intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32,
    num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=168, sliding_window=1024,
    max_position_embeddings=131072, torch_dtype="bfloat16",
)  # fmt: skip

ROWS = {
    "llama3-8b@v5e-4": (LLAMA3_8B, "v5e-4", ["-tp", "4"]),
    "llama3-8b@v6e-1": (LLAMA3_8B, "v6e-1", []),
    "llama3-8b@v6e-8": (LLAMA3_8B, "v6e-8", ["-tp", "8"]),
    "llama3-70b@v6e-8": (LLAMA3_70B, "v6e-8", ["-tp", "8"]),
    "llama3-70b@v5p-8": (LLAMA3_70B, "v5p-8", ["-tp", "4"]),
    "qwen3-30b-a3b@v6e-4": (QWEN3_30B_A3B, "v6e-4", ["-tp", "4", "--enable-expert-parallel"]),
    "gemma3-27b@v6e-4": (GEMMA3_27B, "v6e-4", ["-tp", "4"]),
}
SERVE_FLAGS = ["--max-model-len", "8192", "--no-progress"]


def run_row(name: str, folder: str) -> dict:
    config, topology, flags = ROWS[name]
    model = os.path.join(folder, name)
    os.makedirs(model, exist_ok=True)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(config, f)
    out = os.path.join(folder, f"{name}.json")
    argv = ["jaxengine", "tpu-check", model, "--topology", topology, *flags, *SERVE_FLAGS]
    start = time.perf_counter()
    done = subprocess.run([*argv, "--output", out], capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode and not os.path.exists(out):
        last = [line for line in done.stderr.splitlines() if "tpu-check" in line][-1:]
        return {"row": name, "command": " ".join(argv), "error": " ".join(last), "wall": wall}
    with open(out) as f:
        report = json.load(f)
    return {"row": name, "command": " ".join(argv), "report": report, "wall": wall}


def markdown(results: list[dict]) -> str:
    head = (
        "| model @ slice | fits | KV tokens | compile | decode HBM / minimum | "
        "tok/s batch 1 | tok/s batch 64 |\n|---|---|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['row']} | no: {r['error']} | | {r['wall']:.0f} s | | | |")
            continue
        rep = r["report"]
        decode = [s for s in rep["steps"] if s["kind"] == "decode"]
        worst = max(s["bytes_over_minimum"] for s in decode)
        rates = rep["decode_tokens_per_s"]
        lines.append(
            f"| {r['row']} | {'yes' if rep['fits'] else 'NO'} | {rep['per_chip']['kv_tokens']:,} "
            f"| {rep['compile_seconds']:.0f} s | {worst:.3f}x | {rates['batch_1']:,.0f} | "
            f"{rates['batch_64']:,.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--output", default=None, help="folder for the configs and reports")
    args = parser.parse_args(argv)
    folder = args.output or tempfile.mkdtemp(prefix="tpu-check-")
    results = []
    for name in args.rows:
        results.append(run_row(name, folder))
        print(markdown(results[-1:]).splitlines()[-1], flush=True)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
