"""Multi-LoRA on the real SmolLM2-135M: one batch mixing the base model and two PEFT
adapters gives, per request, the greedy tokens of transformers + peft."""

from __future__ import annotations

from jaxengine import LLM, LoRARequest, SamplingParams
from tests.lora_adapters import make_adapter
from tests.models.hf_reference import hf_greedy

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
NEW_TOKENS = 8


def test_smollm2_mixed_adapters_match_peft(smollm2_gguf, smollm2_hf, smollm2_tokenizer, tmp_path):
    refs = {
        "wide": make_adapter(smollm2_hf, tmp_path / "wide", seed=11, r=8, scale=20.0),
        "attn": make_adapter(
            smollm2_hf, tmp_path / "attn", seed=12, r=4, alpha=8,
            targets=("q_proj", "k_proj", "v_proj", "o_proj"), scale=30.0,
        ),
    }  # fmt: skip
    loras = {name: LoRARequest(name, i + 1, str(tmp_path / name)) for i, name in enumerate(refs)}
    names = [None, "wide", "attn", "wide"]
    ids = [smollm2_tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with LLM(
        model=str(smollm2_gguf),
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        compile_token_buckets=[8, 32],
        swap_space=0,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    ) as llm:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in ids],
            params,
            lora_request=[loras[n] if n else None for n in names],
            use_tqdm=False,
        )
        assert llm.engine.executor.compiles_after_warmup == 0
    got = {}
    for prompt, out, name in zip(ids, outputs, names, strict=True):
        want = hf_greedy(smollm2_hf if name is None else refs[name], prompt, NEW_TOKENS)
        assert out.outputs[0].token_ids == want, name
        got.setdefault(name, []).append(out.outputs[0].token_ids)
    # the adapters change the output (a test that passes with them ignored would be void)
    base = hf_greedy(smollm2_hf, ids[1], NEW_TOKENS)
    assert got["wide"][0] != base and got["attn"][0] != hf_greedy(smollm2_hf, ids[2], NEW_TOKENS)
