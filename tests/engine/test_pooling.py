"""Pooling models offline (`LLM.embed`, `LLM.encode`): a causal LM served as an
embedding model (``--runner pooling``, ``--convert embed``) gives transformers' last
hidden state of the last token, L2-normalized; per-token results, normalization off,
truncation; a mixed batch compiles nothing after warm-up and leaves no page held;
bad requests are clear errors. The real SmolLM2 is checked against transformers too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from tiny_models import tiny_llama_config

from jaxengine import LLM, PoolingParams, SamplingParams
from jaxengine.engine.llm_engine import PromptTooLongError

VOCAB = 64
KWARGS = dict(
    skip_tokenizer_init=True,
    max_model_len=96,
    max_num_seqs=8,
    max_num_batched_tokens=128,
    compile_token_buckets=[16, 128],
    enable_compilation_cache=False,
    swap_space=0,
    dtype="float32",  # the port's arithmetic; a pooling model's auto may be bfloat16
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_llama_config(VOCAB)).eval()
    path = tmp_path_factory.mktemp("pool_tiny")
    model.save_pretrained(path)
    return str(path), model


@pytest.fixture(scope="module")
def llm(tiny):
    engine = LLM(tiny[0], runner="pooling", convert="embed", **KWARGS)
    yield engine
    engine.shutdown()


def _last_hidden(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].numpy()


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rs = np.random.RandomState(seed)
    return [rs.randint(0, VOCAB, rs.randint(1, 90)).tolist() for _ in range(count)]


def test_embeddings_are_the_normalized_last_hidden_state(llm, tiny):
    prompts = _prompts(6)
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for ids, out in zip(prompts, outs, strict=True):
        want = _last_hidden(tiny[1], ids)[-1]
        got = np.asarray(out.outputs.embedding)
        np.testing.assert_allclose(got, want / np.linalg.norm(want), atol=1e-5)
        assert out.prompt_token_ids == ids and out.finished


def test_token_embeddings_unnormalized_and_truncation(llm, tiny):
    ids = _prompts(1, seed=1)[0]
    raw = PoolingParams(normalize=False)
    (tokens,) = llm.encode([{"prompt_token_ids": ids}], raw, pooling_task="token_embed",
                           use_tqdm=False)  # fmt: skip
    np.testing.assert_allclose(tokens.outputs.data, _last_hidden(tiny[1], ids), atol=1e-4)
    (cut,) = llm.encode([{"prompt_token_ids": ids}], raw, truncate_prompt_tokens=5,
                        use_tqdm=False)  # fmt: skip
    np.testing.assert_allclose(cut.outputs.data, _last_hidden(tiny[1], ids[-5:])[-1], atol=1e-4)
    assert cut.prompt_token_ids == ids[-5:]


def test_a_mixed_batch_compiles_nothing_and_frees_every_page(llm, tiny):
    prompts = _prompts(64, seed=2)
    params = [PoolingParams(normalize=i % 2 == 0) for i in range(64)]
    outs = llm.encode([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i in (0, 1, 63):
        want = _last_hidden(tiny[1], prompts[i])[-1]
        want = want / np.linalg.norm(want) if i % 2 == 0 else want
        np.testing.assert_allclose(outs[i].outputs.data, want, atol=1e-4)
    assert llm.engine.executor.compiles_after_warmup == 0
    assert llm.engine.get_stats().kv_cache_usage == 0.0
    assert not llm.engine.has_unfinished_requests()


def test_bad_requests_are_clear_errors(llm, tiny):
    with pytest.raises(PromptTooLongError, match="maximum context length is 96 tokens"):
        llm.embed([{"prompt_token_ids": [1] * 97}], use_tqdm=False)
    with pytest.raises(ValueError, match="does not support matryoshka representation"):
        llm.embed([{"prompt_token_ids": [1, 2]}], pooling_params=PoolingParams(dimensions=8),
                  use_tqdm=False)  # fmt: skip
    with pytest.raises(ValueError, match="serves embeddings .* not text generation"):
        llm.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(max_tokens=2),
                     use_tqdm=False)  # fmt: skip
    with pytest.raises(ValueError, match="pooling task 'reward' is not one of"):
        PoolingParams(task="reward")
    with pytest.raises(ValueError, match="token_classify task .* an embedding model"):
        llm.reward([{"prompt_token_ids": [1, 2]}], use_tqdm=False)
    with pytest.raises(ValueError, match="no classification head"):
        llm.classify([{"prompt_token_ids": [1, 2]}], use_tqdm=False)
    (out,) = llm.embed([{"prompt_token_ids": [3, 4, 5]}], use_tqdm=False)  # still serving
    assert len(out.outputs.embedding) == 64
    generator = LLM(tiny[0], enforce_eager=True, **KWARGS)
    try:
        with pytest.raises(ValueError, match="--runner pooling"):
            generator.embed([{"prompt_token_ids": [1, 2]}], use_tqdm=False)
    finally:
        generator.shutdown()


@pytest.mark.slow
def test_smollm2_embeddings_match_transformers(smollm2_gguf, smollm2_hf, smollm2_tokenizer):
    """SmolLM2 with --convert embed: the last token's last hidden state (transformers,
    after the final norm), normalized, for prompts of varied lengths."""
    texts = ["Hello", "The capital of France is Paris, and the capital of Spain is",
             "def fibonacci(n):\n    if n < 2:\n        return n\n" * 3]  # fmt: skip
    kwargs = dict(max_model_len=256, max_num_batched_tokens=256, compile_token_buckets=[32, 256])
    llm = LLM(str(smollm2_gguf), runner="pooling", convert="embed", swap_space=0, **kwargs)
    try:
        outs = llm.embed(texts, use_tqdm=False)
    finally:
        llm.shutdown()
    for text, out in zip(texts, outs, strict=True):
        ids = smollm2_tokenizer.encode(text)
        want = _last_hidden(smollm2_hf, ids)[-1]
        got = np.asarray(out.outputs.embedding)
        cosine = float(got @ want) / np.linalg.norm(want)
        assert cosine >= 0.9999, (text, cosine)


@pytest.mark.slow
def test_minilm_embeddings_match_sentence_transformers(minilm_dir):
    """all-MiniLM-L6-v2 by its demo name at its default dtype (bfloat16 projections on
    a CPU with AMX-BF16): mean pooling and normalization come from its
    sentence-transformers files; every embedding of a batch of varied lengths is
    transformers' `BertModel` output mean-pooled and normalized (cosine >= 0.9999);
    a score is the cosine of the two embeddings."""
    texts = ["Hi", "A man is eating food.", "Retrieval needs vectors that keep meaning. " * 12]
    llm = LLM("all-MiniLM-L6-v2", max_num_batched_tokens=512, compile_token_buckets=[32, 512])
    try:
        assert llm.engine.pooler.pooling_type == "MEAN" and llm.engine.pooler.normalize
        outs = llm.embed(texts, use_tqdm=False)
        scores = llm.score(texts[0], texts[1:], use_tqdm=False)  # a bi-encoder: cosines
    finally:
        llm.shutdown()
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    model = transformers.AutoModel.from_pretrained(minilm_dir).eval()
    wants, gots = [], [np.asarray(o.outputs.embedding) for o in outs]
    for text, out in zip(texts, outs, strict=True):
        with torch.no_grad():
            hidden = model(**tokenizer([text], return_tensors="pt")).last_hidden_state[0]
        want = hidden.mean(0).numpy()
        wants.append(want / np.linalg.norm(want))
        got = np.asarray(out.outputs.embedding)
        assert float(got @ want) / np.linalg.norm(want) >= 0.9999
    for i, score in enumerate(scores, start=1):
        assert abs(score.outputs.score - float(gots[0] @ gots[i])) < 1e-5
        assert abs(score.outputs.score - float(wants[0] @ wants[i])) < 1e-3
        assert score.prompt_token_ids == outs[0].prompt_token_ids + outs[i].prompt_token_ids
