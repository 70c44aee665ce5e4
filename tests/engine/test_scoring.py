"""Cross-encoder scoring and classification offline (`LLM.score`, `LLM.classify`) on
tiny random `BertForSequenceClassification` checkpoints with all-MiniLM-L6-v2's
tokenizer: a pair is one sequence with the second text's tokens typed 1, and the
score is transformers' logit through a sigmoid (vLLM's cross-encoder score), the
probabilities its logits' softmax, within 1e-4."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from tiny_models import tiny_cross_encoder, tiny_llama_config

from jaxengine import LLM, PoolingParams

KWARGS = dict(max_model_len=128, max_num_batched_tokens=128, compile_token_buckets=[32, 128],
              enable_compilation_cache=False, swap_space=0, dtype="float32")  # fmt: skip
QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "The cat sat on the mat.", "Berlin",
        "France's capital, Paris, lies on the Seine; two million people live there."]  # fmt: skip


@pytest.fixture(scope="module")
def scorer(tmp_path_factory, minilm_dir):
    folder = tmp_path_factory.mktemp("cross_encoder")
    model = tiny_cross_encoder(folder, minilm_dir, 1)
    llm = LLM(str(folder), **KWARGS)
    yield llm, model, transformers.AutoTokenizer.from_pretrained(folder)
    llm.shutdown()


def _logits(model, tokenizer, *texts) -> np.ndarray:
    with torch.no_grad():
        return model(**tokenizer(*texts, return_tensors="pt")).logits[0].numpy()


def test_scores_are_the_cross_encoders_sigmoid(scorer):
    llm, model, tokenizer = scorer
    outs = llm.score(QUERY, DOCS, use_tqdm=False)
    for doc, out in zip(DOCS, outs, strict=True):
        want = 1 / (1 + np.exp(-_logits(model, tokenizer, QUERY, doc)[0]))
        assert abs(out.outputs.score - want) < 1e-4
    pairwise = llm.score([QUERY, DOCS[0]], [DOCS[1], DOCS[2]], use_tqdm=False)
    want = 1 / (1 + np.exp(-_logits(model, tokenizer, DOCS[0], DOCS[2])[0]))
    assert abs(pairwise[1].outputs.score - want) < 1e-4
    raw = llm.score(QUERY, DOCS[:1], pooling_params=PoolingParams(use_activation=False),
                    use_tqdm=False)  # fmt: skip
    assert abs(raw[0].outputs.score - _logits(model, tokenizer, QUERY, DOCS[0])[0]) < 1e-4
    with pytest.raises(ValueError, match="give one first text"):
        llm.score([QUERY, QUERY], DOCS, use_tqdm=False)
    assert llm.engine.executor.compiles_after_warmup == 0
    assert llm.engine.get_stats().kv_cache_usage == 0.0


def test_classify_gives_the_softmax_of_the_logits(tmp_path, minilm_dir):
    model = tiny_cross_encoder(tmp_path, minilm_dir, 3)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    llm = LLM(str(tmp_path), **KWARGS)
    try:
        outs = llm.classify(DOCS, use_tqdm=False)
    finally:
        llm.shutdown()
    for doc, out in zip(DOCS, outs, strict=True):
        logits = _logits(model, tokenizer, doc)
        want = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        np.testing.assert_allclose(out.outputs.probs, want, atol=1e-4)
        assert out.outputs.num_classes == 3


def test_a_decoder_cross_encoder_scores_pairs(tmp_path, smollm2_tokenizer):
    """A one-label `LlamaForSequenceClassification` (a ``score`` head read at the last
    token) with SmolLM2's tokenizer scores a pair as one sequence (the tokenizer's own
    pair layout), and classifies single texts: transformers' sigmoid, within 1e-4.
    (Several labels' softmax is the encoder classifier's test above.)"""
    torch.manual_seed(4)
    vocab = len(smollm2_tokenizer)
    config = tiny_llama_config(vocab, num_labels=1, pad_token_id=0)
    model = transformers.LlamaForSequenceClassification(config).eval()
    model.save_pretrained(tmp_path)
    smollm2_tokenizer.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), **KWARGS)
    try:
        outs = llm.score(QUERY, DOCS, use_tqdm=False)
        classes = llm.classify(DOCS, use_tqdm=False)
        assert llm.engine.executor.compiles_after_warmup == 0
    finally:
        llm.shutdown()
    sigmoid = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    for doc, out, cls in zip(DOCS, outs, classes, strict=True):
        with torch.no_grad():
            logit = model(**smollm2_tokenizer(QUERY, doc, return_tensors="pt")).logits[0, 0]
            alone = model(**smollm2_tokenizer(doc, return_tensors="pt")).logits[0, 0]
        assert abs(out.outputs.score - sigmoid(logit.item())) < 1e-4
        np.testing.assert_allclose(cls.outputs.probs, [sigmoid(alone.item())], atol=1e-4)
