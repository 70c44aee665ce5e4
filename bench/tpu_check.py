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
    python -m bench.tpu_check --rows phi-4@v6e-4 --layers 2 --extra "--max-num-seqs 4"  # smoke
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

MIXTRAL_8X7B = dict(
    architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=32000,
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
    max_position_embeddings=32768, rope_theta=1000000.0, torch_dtype="bfloat16",
)  # fmt: skip
PHI4 = dict(
    architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=100352, hidden_size=5120,
    intermediate_size=17920, num_hidden_layers=40, num_attention_heads=40,
    num_key_value_heads=10, max_position_embeddings=16384,
    original_max_position_embeddings=16384, rope_theta=250000.0, torch_dtype="bfloat16",
)  # fmt: skip
GLM45_AIR = dict(
    architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", vocab_size=151552,
    hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
    num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
    n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=1,
    n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True,
    partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=False,
    max_position_embeddings=131072, rope_theta=1000000.0, torch_dtype="bfloat16",
)  # fmt: skip
GPT_OSS_120B = dict(
    architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=201088,
    hidden_size=2880, intermediate_size=2880, num_hidden_layers=36, num_attention_heads=64,
    num_key_value_heads=8, head_dim=64, num_local_experts=128, num_experts_per_tok=4,
    experts_per_token=4, sliding_window=128,
    layer_types=["sliding_attention", "full_attention"] * 18, attention_bias=True,
    swiglu_limit=7.0, max_position_embeddings=131072, rope_theta=150000.0,
    rope_scaling=dict(
        rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
        original_max_position_embeddings=4096, truncate=False,
    ),
    quantization_config=dict(
        quant_method="mxfp4",
        modules_to_not_convert=["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                "model.embed_tokens", "lm_head"],
    ),
    torch_dtype="bfloat16",
)  # fmt: skip
LLAMA4_SCOUT = dict(
    architectures=["Llama4ForCausalLM"], model_type="llama4_text", vocab_size=202048,
    hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
    num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
    num_local_experts=16, num_experts_per_tok=1, interleave_moe_layer_step=1,
    no_rope_layers=[0 if (i + 1) % 4 == 0 else 1 for i in range(48)],
    attention_chunk_size=8192, use_qk_norm=True, attn_temperature_tuning=True,
    floor_scale=8192, attn_scale=0.1, max_position_embeddings=10485760, rope_theta=500000.0,
    rope_scaling=dict(
        rope_type="llama3", factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0,
        original_max_position_embeddings=8192,
    ),
    torch_dtype="bfloat16",
)  # fmt: skip

DEEPSEEK_V3 = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=129280,
    hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
    first_k_dense_replace=3, n_group=8, topk_group=4, routed_scaling_factor=2.5,
    norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
    max_position_embeddings=163840, rope_theta=10000.0,
    rope_scaling=dict(
        type="yarn", rope_type="yarn", factor=40.0, beta_fast=32, beta_slow=1, mscale=1.0,
        mscale_all_dim=1.0, original_max_position_embeddings=4096,
    ),
    quantization_config=dict(
        quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[128, 128],
    ),  # as published: block fp8
    torch_dtype="bfloat16",
)  # fmt: skip


def _defaults(config_class: str, architecture: str) -> dict:
    """A transformers config class's defaults (its reference checkpoint's dimensions)."""
    import transformers

    config = getattr(transformers, config_class)().to_dict()
    return dict(config, architectures=[architecture], torch_dtype="bfloat16")


QWEN3_NEXT_80B_A3B = _defaults("Qwen3NextConfig", "Qwen3NextForCausalLM")
QWEN3_5 = _defaults("Qwen3_5TextConfig", "Qwen3_5ForCausalLM")
GEMMA4 = _defaults("Gemma4TextConfig", "Gemma4ForCausalLM")
QWEN3_5_VL = _defaults("Qwen3_5Config", "Qwen3_5ForConditionalGeneration")
# Qwen3.5-9B's (the text defaults' checkpoint): the tower projects onto the 4096-wide
# decoder; transformers' default out_hidden_size (3584, Qwen3-VL's) matches no decoder
QWEN3_5_VL["vision_config"] = dict(QWEN3_5_VL["vision_config"], out_hidden_size=4096)
# gemma-4-e2b-it's tower: Gemma4Config's default has none, Gemma4VisionConfig's defaults
GEMMA4_VL = dict(
    _defaults("Gemma4Config", "Gemma4ForConditionalGeneration"),
    vision_config=_defaults("Gemma4VisionConfig", "Gemma4VisionModel"),
)

ROWS = {
    "llama3-8b@v5e-4": (LLAMA3_8B, "v5e-4", ["-tp", "4"]),
    "llama3-8b@v6e-1": (LLAMA3_8B, "v6e-1", []),
    "llama3-8b@v6e-8": (LLAMA3_8B, "v6e-8", ["-tp", "8"]),
    "llama3-70b@v6e-8": (LLAMA3_70B, "v6e-8", ["-tp", "8"]),
    "llama3-70b@v5p-8": (LLAMA3_70B, "v5p-8", ["-tp", "4"]),
    "qwen3-30b-a3b@v6e-4": (QWEN3_30B_A3B, "v6e-4", ["-tp", "4", "--enable-expert-parallel"]),
    "gemma3-27b@v6e-4": (GEMMA3_27B, "v6e-4", ["-tp", "4"]),
    "mixtral-8x7b@v6e-8": (MIXTRAL_8X7B, "v6e-8", ["-tp", "8", "--enable-expert-parallel"]),
    "phi-4@v6e-4": (PHI4, "v6e-4", ["-tp", "2"]),
    "glm-4.5-air@v6e-8": (GLM45_AIR, "v6e-8", ["-tp", "8", "--enable-expert-parallel"]),
    "gpt-oss-120b@v6e-8": (GPT_OSS_120B, "v6e-8", ["-tp", "8", "--enable-expert-parallel"]),
    "llama4-scout@v6e-8": (LLAMA4_SCOUT, "v6e-8", ["-tp", "8", "--enable-expert-parallel"]),
    # TP 16: block fp8's 128-column groups split evenly (18432 / 16 = 9 x 128; at TP 32
    # a group would straddle two chips, which the loader refuses, as vLLM does)
    "deepseek-v3@v5p-32": (DEEPSEEK_V3, "v5p-32", ["-tp", "16", "--enable-expert-parallel"]),
    "qwen3-next-80b-a3b@v6e-8": (
        QWEN3_NEXT_80B_A3B,
        "v6e-8",
        ["-tp", "8", "--enable-expert-parallel"],
    ),
    "qwen3.5@v6e-4": (QWEN3_5, "v6e-4", ["-tp", "4"]),
    "gemma4@v6e-1": (GEMMA4, "v6e-1", []),
    "qwen3.5-vl@v6e-4": (QWEN3_5_VL, "v6e-4", ["-tp", "4"]),
    "gemma4-vl@v6e-1": (GEMMA4_VL, "v6e-1", []),
}
PER_LAYER_LISTS = ("layer_types", "no_rope_layers")
"""Config entries with one item per layer, cut with the depth (`--layers`)."""
SERVE_FLAGS = ["--max-model-len", "8192", "--no-progress"]


def at_depth(config: dict, layers: int | None) -> dict:
    """``config`` with its first ``layers`` layers (None: all of them); a vision-language
    config's decoder's (``text_config``), its vision tower whole."""
    if layers is None:
        return config
    if "text_config" in config:
        return dict(config, text_config=at_depth(config["text_config"], layers))
    cut = dict(config, num_hidden_layers=layers)
    for key in PER_LAYER_LISTS:
        if key in cut:
            cut[key] = cut[key][:layers]
    return cut


def run_row(name: str, folder: str, layers: int | None = None, extra: list | None = None) -> dict:
    config, topology, flags = ROWS[name]
    config, flags = at_depth(config, layers), [*flags, *(extra or [])]
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
            f"| {rep['compile_seconds']:.0f} s | {worst:.3f}x | {_rate(rates['batch_1'])} | "
            f"{_rate(rates['batch_64'])} |"
        )
    return "\n".join(lines)


def _rate(tokens_per_s: float | None) -> str:
    """A decode rate, or "-" where the row's batch exceeds its --max-num-seqs."""
    return "-" if tokens_per_s is None else f"{tokens_per_s:,.0f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--output", default=None, help="folder for the configs and reports")
    parser.add_argument(
        "--layers", type=int, default=None, help="a smoke run: the first N layers only"
    )
    parser.add_argument(
        "--extra", default="", help='more tpu-check flags for every row, e.g. "--max-num-seqs 4"'
    )
    args = parser.parse_args(argv)
    folder = args.output or tempfile.mkdtemp(prefix="tpu-check-")
    results = []
    for name in args.rows:
        results.append(run_row(name, folder, args.layers, args.extra.split()))
        print(markdown(results[-1:]).splitlines()[-1], flush=True)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
