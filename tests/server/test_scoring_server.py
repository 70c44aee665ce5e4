"""/score, /rerank and /classify (and their /v1/ aliases) on a real `jaxengine serve`
of a tiny random cross-encoder (`BertForSequenceClassification`, one label, BERT's
tokenizer), over plain HTTP as vLLM's clients call them: each score is transformers'
logit through a sigmoid within 1e-4; rerank orders the documents by it, keeps
``top_n`` and returns the documents; an embedding request to it is a 400."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from tiny_models import tiny_cross_encoder

from tests.server.conftest import start_server, stop_server

QUERY = "How many people live in Berlin?"
DOCS = ["Berlin has about 3.7 million inhabitants.", "The weather is nice today.",
        "Berlin is the capital of Germany.", "Potatoes grow underground."]  # fmt: skip
FLAGS = ["--api-key", "test-key", "--served-model-name", "ranker", "--max-model-len", "128",
         "--max-num-batched-tokens", "128", "--compile-token-buckets", "32", "128",
         "--disable-uvicorn-access-log", "--dtype", "float32"]  # fmt: skip


@pytest.fixture(scope="module")
def ranker(minilm_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ranker")
    model = tiny_cross_encoder(folder, minilm_dir, 1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    running = start_server(tmp_path_factory.mktemp("ranker-log") / "server.log",
                           [str(folder), *FLAGS])  # fmt: skip
    yield running, model, tokenizer
    stop_server(running)


def _sigmoid(model, tokenizer, *texts) -> float:
    with torch.no_grad():
        logit = model(**tokenizer(*texts, return_tensors="pt")).logits[0, 0].item()
    return 1 / (1 + np.exp(-logit))


def test_score_and_its_alias(ranker):
    server, model, tokenizer = ranker
    want = [_sigmoid(model, tokenizer, QUERY, d) for d in DOCS]
    for path in ("/score", "/v1/score"):
        body = server.post(path, {"model": "ranker", "text_1": QUERY, "text_2": DOCS}).json()
        assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
        got = [d["score"] for d in body["data"]]
        np.testing.assert_allclose(got, want, atol=1e-4)
        assert body["usage"]["prompt_tokens"] > len(DOCS)
    bad = server.post("/score", {"model": "ranker", "text_1": [QUERY, QUERY], "text_2": DOCS})
    assert bad.status_code == 400 and "give one first text" in bad.json()["error"]["message"]


def test_rerank_orders_by_score(ranker):
    server, model, tokenizer = ranker
    want = [_sigmoid(model, tokenizer, QUERY, d) for d in DOCS]
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    for path in ("/rerank", "/v1/rerank"):
        body = server.post(path, {"model": "ranker", "query": QUERY, "documents": DOCS,
                                  "top_n": 2}).json()  # fmt: skip
        results = body["results"]
        assert [r["index"] for r in results] == order[:2]
        for r in results:
            assert abs(r["relevance_score"] - want[r["index"]]) < 1e-4
            assert r["document"] == {"text": DOCS[r["index"]]}
        assert body["usage"]["total_tokens"] > 0


def test_classify_and_what_it_refuses(ranker):
    server, model, tokenizer = ranker
    body = server.post("/classify", {"model": "ranker", "input": DOCS[:2]}).json()
    for i, item in enumerate(body["data"]):
        assert item["num_classes"] == 1 and item["label"] == "LABEL_0"
        assert abs(item["probs"][0] - _sigmoid(model, tokenizer, DOCS[i])) < 1e-4
    embed = server.post("/v1/embeddings", {"model": "ranker", "input": "Hi"})
    assert embed.status_code == 400 and "classification model" in embed.json()["error"]["message"]
    # vLLM's /pooling runs a classifier's tasks too: per text, and per token
    pooled = server.post("/pooling", {"model": "ranker", "input": DOCS[0], "task": "classify"})
    assert abs(pooled.json()["data"][0]["data"][0] - _sigmoid(model, tokenizer, DOCS[0])) < 1e-4
    body = {"model": "ranker", "input": DOCS[0], "task": "token_classify"}
    per_token = server.post("/pooling", body).json()["data"][0]["data"]
    assert len(per_token) == len(tokenizer(DOCS[0])["input_ids"]) and len(per_token[0]) == 1
