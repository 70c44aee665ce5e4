"""/v1/embeddings on a real `jaxengine serve` of the all-MiniLM-L6-v2 demo model
(BERT; sentence-transformers' mean pooling and normalization, read from its files),
with the official `openai` client: every embedding of a batch of varied lengths is
transformers' `BertModel` output mean-pooled over the tokens and L2-normalized
(cosine >= 0.9999), as floats and as base64, from texts, token ids and chat-style
``messages``; usage; truncation; and the requests it cannot serve are 400s."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
import transformers

from tests.server.conftest import start_server, stop_server

SENTENCES = [
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog near the bank of the river on a sunny day.",
    "Hi",
    "Embeddings map text to vectors; similar texts get similar vectors, which is what "
    "retrieval needs. " * 3,
]
FLAGS = ["--api-key", "test-key", "--served-model-name", "minilm", "--max-num-seqs", "8",
         "--max-num-batched-tokens", "512", "--compile-token-buckets", "32", "512",
         "--disable-uvicorn-access-log",
         "--trust-request-chat-template"]  # test_chat_style_messages sends one  # fmt: skip


@pytest.fixture(scope="module")
def embed_server(minilm_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("embed-server") / "server.log"
    running = start_server(log, [str(minilm_dir), *FLAGS])
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def reference(minilm_dir):
    """sentence-transformers' all-MiniLM-L6-v2: BertModel, mean pooling, normalized."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    model = transformers.AutoModel.from_pretrained(minilm_dir).eval()

    def embed(text: str, add_special_tokens: bool = True) -> np.ndarray:
        batch = tokenizer([text], return_tensors="pt", add_special_tokens=add_special_tokens)
        with torch.no_grad():
            hidden = model(**batch).last_hidden_state[0]
        mean = hidden.mean(0).numpy()
        return mean / np.linalg.norm(mean)

    return embed


def _cosines(got, want) -> list[float]:
    return [float(np.dot(g, w) / np.linalg.norm(g)) for g, w in zip(got, want, strict=True)]


def test_openai_client_embeddings_match_sentence_transformers(embed_server, reference):
    client = embed_server.client(max_retries=0, timeout=120)
    want = [reference(s) for s in SENTENCES]
    floats = client.embeddings.create(model="minilm", input=SENTENCES, encoding_format="float")
    assert [d.index for d in floats.data] == list(range(len(SENTENCES)))
    assert min(_cosines([d.embedding for d in floats.data], want)) >= 0.9999
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > len(SENTENCES)
    packed = client.embeddings.create(model="minilm", input=SENTENCES)  # base64 on the wire
    assert min(_cosines([d.embedding for d in packed.data], want)) >= 0.9999
    assert len(packed.data[0].embedding) == 384


def test_token_ids_truncation_and_errors(embed_server, reference, minilm_dir):
    ids = transformers.AutoTokenizer.from_pretrained(minilm_dir)(SENTENCES[0])["input_ids"]
    body = embed_server.post("/v1/embeddings", {"model": "minilm", "input": ids}).json()
    assert _cosines([body["data"][0]["embedding"]], [reference(SENTENCES[0])])[0] >= 0.9999
    bad = embed_server.post("/v1/completions", {"model": "minilm", "prompt": "Hi", "max_tokens": 2})
    assert bad.status_code == 400 and "not text generation" in bad.json()["error"]["message"]
    dims = embed_server.post("/v1/embeddings", {"model": "minilm", "input": "Hi", "dimensions": 8})
    assert dims.status_code == 400 and "matryoshka" in dims.json()["error"]["message"]
    long = embed_server.post("/v1/embeddings", {"model": "minilm", "input": "word " * 600})
    assert long.status_code == 400
    assert "maximum context length is 512 tokens" in long.json()["error"]["message"]
    cut = embed_server.post("/v1/embeddings", {"model": "minilm", "input": "word " * 600,
                                               "truncate_prompt_tokens": 100})  # fmt: skip
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 100


def test_chat_style_messages(embed_server, reference):
    """vLLM's chat-style embedding request: ``messages`` rendered by the chat template
    (here one given in the request: the model has none), then embedded."""
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    messages = [{"role": "user", "content": SENTENCES[1]}]
    body = {"model": "minilm", "messages": messages, "chat_template": template}
    got = embed_server.post("/v1/embeddings", body).json()["data"][0]["embedding"]
    want = reference(SENTENCES[1], add_special_tokens=False)
    assert _cosines([got], [want])[0] >= 0.9999
    both = embed_server.post("/v1/embeddings", {**body, "input": "Hi"})
    assert both.status_code == 400 and "exactly one of" in both.json()["error"]["message"]


def test_an_embedding_model_scores_as_a_bi_encoder(embed_server, reference):
    """vLLM's bi-encoder scoring: /score and /rerank on an embedding model give the
    cosine similarity of the two texts' embeddings (sentence-transformers' here);
    /classify still needs a classification head."""
    query, docs = SENTENCES[0], SENTENCES[1:]
    want = [float(reference(query) @ reference(d)) for d in docs]
    body = {"model": "minilm", "text_1": query, "text_2": docs}
    scores = [d["score"] for d in embed_server.post("/score", body).json()["data"]]
    np.testing.assert_allclose(scores, want, atol=1e-3)  # bfloat16 projections (AMX CPU)
    body = {"model": "minilm", "query": query, "documents": docs, "top_n": 2}
    ranked = embed_server.post("/v1/rerank", body).json()["results"]
    assert [r["index"] for r in ranked] == list(np.argsort(want)[::-1][:2])
    body = {"model": "minilm", "text_1": "a", "text_2": "b", "use_activation": False}
    bad = embed_server.post("/score", body)
    assert bad.status_code == 400 and "cosine similarity" in bad.json()["error"]["message"]
    body = {"model": "minilm", "input": ["a"]}
    bad = embed_server.post("/classify", body)
    assert bad.status_code == 400 and "no classification head" in bad.json()["error"]["message"]


def test_pooling_endpoint(embed_server, reference, minilm_dir):
    """vLLM's /pooling: "embed" gives what /v1/embeddings gives; "token_embed" one
    normalized vector per prompt token."""
    body = {"model": "minilm", "input": SENTENCES[0]}
    pooled = embed_server.post("/pooling", body).json()["data"][0]
    assert pooled["object"] == "pooling"
    assert _cosines([pooled["data"]], [reference(SENTENCES[0])])[0] >= 0.9999
    tokens = embed_server.post("/pooling", {**body, "task": "token_embed"}).json()["data"][0]
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    model = transformers.AutoModel.from_pretrained(minilm_dir).eval()
    with torch.no_grad():
        hidden = model(**tokenizer([SENTENCES[0]], return_tensors="pt")).last_hidden_state[0]
    want = hidden.numpy() / np.linalg.norm(hidden.numpy(), axis=-1, keepdims=True)
    got = np.asarray(tokens["data"])
    assert got.shape == want.shape and np.min(np.sum(got * want, axis=-1)) >= 0.9999
    reward = embed_server.post("/pooling", {**body, "task": "token_classify"})
    message = reward.json()["error"]["message"]
    assert reward.status_code == 400 and "token_classify task is not one of" in message


def test_cohere_v2_embed(embed_server, reference, minilm_dir):
    """Cohere's /v2/embed: float vectors equal /v1/embeddings' (and sentence-
    transformers'), base64 and the sign-bit packings encode them, billed tokens are
    the prompts'; truncate END/START cut the text as the tokenizer does from that side
    (its special tokens kept), NONE refuses; int8 and images are 400s."""
    body = {"model": "minilm", "texts": SENTENCES[:2], "input_type": "search_document",
            "embedding_types": ["float", "base64", "ubinary", "binary"]}  # fmt: skip
    got = embed_server.post("/v2/embed", body).json()
    assert got["response_type"] == "embeddings_by_type" and got["texts"] == SENTENCES[:2]
    floats = np.asarray(got["embeddings"]["float"])
    assert min(_cosines(floats, [reference(s) for s in SENTENCES[:2]])) >= 0.9999
    v1 = embed_server.post("/v1/embeddings", {"model": "minilm", "input": SENTENCES[:2]}).json()
    np.testing.assert_allclose(floats, [d["embedding"] for d in v1["data"]], atol=1e-6)
    assert got["meta"]["billed_units"]["input_tokens"] == v1["usage"]["prompt_tokens"]
    decoded = [np.frombuffer(base64.b64decode(b), "<f4") for b in got["embeddings"]["base64"]]
    np.testing.assert_array_equal(decoded, floats.astype(np.float32))
    packed = np.packbits(floats > 0, axis=-1)
    assert got["embeddings"]["ubinary"] == packed.tolist()
    assert got["embeddings"]["binary"] == (packed.astype(int) - 128).tolist()

    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    text = SENTENCES[1]
    for side, truncate in (("right", "END"), ("left", "START")):
        tokenizer.truncation_side = side
        ids = tokenizer(text, truncation=True, max_length=8)["input_ids"]
        want = embed_server.post("/v1/embeddings", {"model": "minilm", "input": ids}).json()
        body = {"model": "minilm", "texts": [text], "max_tokens": 8, "truncate": truncate}
        cut = embed_server.post("/v2/embed", body).json()
        assert cut["meta"]["billed_units"]["input_tokens"] == 8
        np.testing.assert_allclose(
            cut["embeddings"]["float"][0], want["data"][0]["embedding"], atol=1e-6
        )
    for change, needle in (
        ({"truncate": "NONE", "max_tokens": 8}, "more than 8"),
        ({"embedding_types": ["int8"]}, "int8"),
        ({"images": ["data:image/png;base64,AAAA"]}, "images"),
    ):
        bad = embed_server.post("/v2/embed", {"model": "minilm", "texts": [text], **change})
        assert bad.status_code == 400 and needle in bad.json()["error"]["message"], bad.text
