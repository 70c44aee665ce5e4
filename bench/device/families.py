"""Tiny random Llama, Qwen3 and Gemma 3 models: the engine's greedy tokens against
transformers'.

Each family's model is built here with transformers from a tiny config (two layers,
hidden size 128, head dim 32, a vocabulary of 320; Gemma 3 with one sliding-window
layer of 8 and one full layer, its soft-capped logits), seeded, and saved with
``save_pretrained`` to a temporary folder: nothing large travels to the machine.
Ragged prompts of random ids (lengths 5, 17, 2 and 11) go through
``LLM(folder, dtype="float32")`` in one batch, greedily, EOS ignored; transformers
decodes the same prompts greedily in float32 on the CPU (a plain argmax loop over
full forwards). The float32 engine must give exactly transformers' tokens. The same
prompts through ``LLM(folder, dtype="bfloat16")`` give the bf16 agreement: the mean
common prefix with transformers' float32 tokens (`common.agreement`, 1.0 = all the
same), and the plain fraction of equal tokens, position by position.

The weights are drawn with a standard deviation of 0.2, not transformers' 0.02, so
that the next-token logits are spread and near-ties (which any change of summation
order may flip) are rare.
"""

from __future__ import annotations

import tempfile
from typing import Any

import numpy as np

from bench.device.profile import Profile
from jaxengine.benchmarks.common import agreement

BASE = dict(
    vocab_size=320,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
)
PROMPT_LENS = (5, 17, 2, 11)


def family_config(family: str) -> Any:
    """The tiny transformers config of ``family`` (llama, qwen3 or gemma3)."""
    import transformers

    if family == "llama":
        return transformers.LlamaConfig(**BASE)
    if family == "qwen3":
        return transformers.Qwen3Config(**BASE, head_dim=32)
    if family == "gemma3":
        return transformers.Gemma3TextConfig(
            **BASE,
            head_dim=32,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=32,
            final_logit_softcapping=30.0,
        )
    raise ValueError(f"unknown family {family!r}")


FAMILIES = ("llama", "qwen3", "gemma3")


def hf_greedy(model: Any, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Greedy continuations by transformers: an argmax loop over full forwards."""
    import torch

    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            seq = list(prompt)
            for _ in range(tokens):
                logits = model(torch.tensor([seq])).logits[0, -1]
                seq.append(int(torch.argmax(logits)))
            outputs.append(seq[len(prompt) :])
    return outputs


def engine_greedy(
    folder: str, dtype: str, prompts: list[list[int]], tokens: int, engine_kwargs: dict
) -> list[list[int]]:
    from jaxengine import LLM, SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    with LLM(folder, dtype=dtype, **engine_kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def engine_kwargs(profile: Profile, cache_dir: str) -> dict:
    longest = max(PROMPT_LENS) + profile.family_tokens
    return {
        "skip_tokenizer_init": True,
        "max_model_len": longest + 16,
        "max_num_seqs": len(PROMPT_LENS),
        "max_num_batched_tokens": 64,
        "compile_token_buckets": [64],  # one step shape: the prompts and the decodes
        "enable_prefix_caching": False,
        "num_gpu_blocks_override": 64,  # not the GPU's memory: four short requests
        "swap_space": 0,
        "compilation_cache_dir": cache_dir,
        "enforce_eager": profile.eager_variants,
    }


def check_family(family: str, profile: Profile, cache_dir: str) -> dict[str, Any]:
    """One family: float32 tokens against transformers', and the bf16 agreement."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(family_config(family)).float().eval()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, BASE["vocab_size"], n).tolist() for n in PROMPT_LENS]
    want = hf_greedy(model, prompts, profile.family_tokens)
    kwargs = engine_kwargs(profile, cache_dir)
    with tempfile.TemporaryDirectory(prefix=f"device-{family}-") as folder:
        model.save_pretrained(folder)
        got32 = engine_greedy(folder, "float32", prompts, profile.family_tokens, kwargs)
        got16 = engine_greedy(folder, "bfloat16", prompts, profile.family_tokens, kwargs)
    return {
        "architecture": type(model).__name__,
        "prompts": len(prompts),
        "tokens": profile.family_tokens,
        "float32_match": got32 == want,
        "float32_equal_fraction": equal_fraction(got32, want),
        "bf16_agreement": agreement(got16, want),
        "bf16_equal_fraction": equal_fraction(got16, want),
    }


def equal_fraction(outputs: list[list[int]], reference: list[list[int]]) -> float:
    """Fraction of positions where the tokens are the same (lengths as the reference)."""
    same = 0
    for out, ref in zip(outputs, reference, strict=True):
        same += sum(a == b for a, b in zip(out, ref, strict=False))  # a short output: fewer
    return same / max(sum(len(ref) for ref in reference), 1)
