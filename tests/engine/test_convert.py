"""Generative checkpoints served as pooling models (vLLM's ``--convert``), on tiny
random decoders with SmolLM2's tokenizer, against transformers' causal LM:

- an LLM reranker (a Qwen3 causal LM named ``Qwen3ForSequenceClassification`` with
  ``classifier_from_token`` by ``--hf-overrides``, as vLLM serves Qwen3-Reranker):
  its score is the softmax of the "no"/"yes" logits at the last token;
- ``--convert classify`` with ``no_post_processing`` on a tied Llama: the
  probabilities are the softmax of the named tokens' logits;
- ``--convert reward``: every token's last hidden state, not normalized.

All within 1e-4, with no compilation after warm-up and no page left allocated."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from tiny_models import tiny_llama_config

from jaxengine import LLM

KWARGS = dict(max_model_len=128, max_num_batched_tokens=128, compile_token_buckets=[32, 128],
              enable_compilation_cache=False, swap_space=0, dtype="float32")  # fmt: skip
QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "The cat sat on the mat.", "Berlin"]


def _save(model, tokenizer, folder):
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _last_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].double().numpy()


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _served(llm: LLM) -> None:
    assert llm.engine.executor.compiles_after_warmup == 0
    assert llm.engine.get_stats().kv_cache_usage == 0.0


def test_an_llm_reranker_scores_with_its_yes_and_no_logits(tmp_path, smollm2_tokenizer):
    torch.manual_seed(7)
    config = transformers.Qwen3Config(
        vocab_size=len(smollm2_tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.Qwen3ForCausalLM(config).eval()
    overrides = {
        "architectures": ["Qwen3ForSequenceClassification"],
        "classifier_from_token": ["no", "yes"],
        "is_original_qwen3_reranker": True,
    }
    llm = LLM(_save(model, smollm2_tokenizer, tmp_path), hf_overrides=overrides, **KWARGS)
    try:
        scores = llm.score(QUERY, DOCS, use_tqdm=False)
        classes = llm.classify(DOCS, use_tqdm=False)
        _served(llm)
    finally:
        llm.shutdown()
    no, yes = smollm2_tokenizer.convert_tokens_to_ids(["no", "yes"])
    for doc, score, cls in zip(DOCS, scores, classes, strict=True):
        pair = _last_logits(model, smollm2_tokenizer(QUERY, doc)["input_ids"])
        assert abs(score.outputs.score - _softmax(pair[[no, yes]])[1]) < 1e-4
        alone = _last_logits(model, smollm2_tokenizer(doc)["input_ids"])
        np.testing.assert_allclose(cls.outputs.probs, [_softmax(alone[[no, yes]])[1]], atol=1e-4)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, smollm2_tokenizer):
    """A tiny random Llama causal LM with tied embeddings, saved with its tokenizer."""
    torch.manual_seed(3)
    config = tiny_llama_config(len(smollm2_tokenizer), tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config).eval()
    return model, _save(model, smollm2_tokenizer, tmp_path_factory.mktemp("llama"))


def test_convert_classify_takes_its_head_from_the_lm_head(tiny_llama, smollm2_tokenizer):
    model, folder = tiny_llama
    tokens = ["yes", "no", "maybe"]
    overrides = {"classifier_from_token": tokens, "method": "no_post_processing"}
    llm = LLM(folder, convert="classify", hf_overrides=overrides, **KWARGS)
    try:
        outs = llm.classify(DOCS, use_tqdm=False)
        per_token = llm.reward(DOCS[:1], use_tqdm=False)[0].outputs.data
        _served(llm)
    finally:
        llm.shutdown()
    ids = smollm2_tokenizer.convert_tokens_to_ids(tokens)
    for doc, out in zip(DOCS, outs, strict=True):
        logits = _last_logits(model, smollm2_tokenizer(doc)["input_ids"])
        np.testing.assert_allclose(out.outputs.probs, _softmax(logits[ids]), atol=1e-4)
    # "token_classify": the head's probabilities at every token, the last as classify's
    prompt = smollm2_tokenizer(DOCS[0])["input_ids"]
    assert np.asarray(per_token).shape == (len(prompt), len(tokens))
    np.testing.assert_allclose(per_token[-1], outs[0].outputs.probs, atol=1e-6)


def test_convert_reward_returns_every_tokens_hidden_state(tiny_llama, smollm2_tokenizer):
    model, folder = tiny_llama
    llm = LLM(folder, convert="reward", **KWARGS)
    try:
        outs = llm.reward(DOCS, use_tqdm=False)
        with pytest.raises(ValueError, match="reward model"):
            llm.embed(DOCS[:1], use_tqdm=False)
        _served(llm)
    finally:
        llm.shutdown()
    for doc, out in zip(DOCS, outs, strict=True):
        ids = smollm2_tokenizer(doc)["input_ids"]
        with torch.no_grad():
            want = model.model(torch.tensor([ids])).last_hidden_state[0].numpy()
        np.testing.assert_allclose(np.asarray(out.outputs.data), want, atol=1e-4)
