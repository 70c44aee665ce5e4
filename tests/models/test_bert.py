"""BERT against transformers: tiny random encoders, and the real all-MiniLM-L6-v2.

Each tiny model (a `BertModel`, a `BertForSequenceClassification` with 3 labels) is
saved with ``save_pretrained``, loaded through `jaxengine.loader.load_model`, and run
on one packed batch of requests of different lengths plus padding rows: every
request's hidden states must equal transformers' ``last_hidden_state`` and the
classifier's logits of its [CLS] row transformers' logits, in float32.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxengine.config import LoadConfig, ModelConfig
from jaxengine.loader import load_model
from jaxengine.loader.errors import CheckpointError
from jaxengine.loader.params import checkpoint_names, params_from_tensors
from jaxengine.loader.safetensors_io import iter_safetensors
from jaxengine.models.layers.attention import kv_cache_shape
from jaxengine.models.layers.metadata import AttentionMetadata
from jaxengine.runner.batch import SeqChunk, pack_batch
from tests.models.hf_reference import reference_threads

TINY = dict(
    vocab_size=120,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=48,
    max_position_embeddings=64,
    num_labels=3,
)
LENGTHS = (7, 1, 13, 4)  # packed into 32 token rows (7 padding) and 6 request rows
PAGE_SIZE = 64  # one page holds any prompt here


@pytest.fixture(scope="module")
def tiny_berts(tmp_path_factory):
    """``{"BertModel" | "BertForSequenceClassification": (transformers model, loaded)}``."""
    torch.manual_seed(0)
    config = transformers.BertConfig(**TINY)
    models = {}
    for cls in (transformers.BertModel, transformers.BertForSequenceClassification):
        hf = cls(config).eval()
        folder = tmp_path_factory.mktemp(cls.__name__)
        hf.save_pretrained(folder)
        models[cls.__name__] = (
            hf,
            load_model(ModelConfig(model=str(folder), dtype="float32"), LoadConfig()),
        )
    return models


def prompts_of(lengths, vocab_size, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab_size, n).tolist() for n in lengths]


def run_packed(loaded, prompts, num_tokens=32, num_reqs=6, pad_token=0):
    """Our hidden states ``[T, H]`` of one packed batch and its query_start_loc."""
    chunks = [SeqChunk(p, 0, [1 + i]) for i, p in enumerate(prompts)]
    batch = pack_batch(
        chunks, page_size=PAGE_SIZE, num_tokens=num_tokens, num_reqs=num_reqs, pages_per_req=1
    )
    token_ids = batch.token_ids.copy()
    token_ids[batch.query_start_loc[len(prompts)] :] = pad_token
    md = AttentionMetadata(**{k: jnp.asarray(v) for k, v in batch.metadata_fields().items()})
    variables = {"params": loaded.params}
    page = kv_cache_shape(loaded.config, 1 + len(prompts), PAGE_SIZE)
    caches = tuple(jnp.zeros(page, jnp.float32) for _ in loaded.config.layers)
    hidden, caches = loaded.module.apply(
        variables, jnp.asarray(token_ids), jnp.asarray(batch.positions), caches, md
    )
    assert len(caches) == len(loaded.config.layers)
    return np.asarray(hidden), batch.query_start_loc


def hf_forward(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]), output_hidden_states=True)


@pytest.mark.parametrize("arch", ["BertModel", "BertForSequenceClassification"])
def test_hidden_states_match_transformers(tiny_berts, arch):
    hf, loaded = tiny_berts[arch]
    assert type(loaded.module).__name__ == arch
    assert not loaded.config.fused_projections and loaded.config.bidirectional
    prompts = prompts_of(LENGTHS, TINY["vocab_size"])
    hidden, qsl = run_packed(loaded, prompts)
    assert np.isfinite(hidden).all()  # padding rows included
    for r, ids in enumerate(prompts):
        ref = hf_forward(hf, ids).hidden_states[-1][0].numpy()  # == last_hidden_state
        np.testing.assert_allclose(hidden[qsl[r] : qsl[r + 1]], ref, atol=1e-4, rtol=0)


def test_classify_matches_transformers_logits(tiny_berts):
    hf, loaded = tiny_berts["BertForSequenceClassification"]
    assert loaded.config.num_labels == 3
    prompts = prompts_of(LENGTHS, TINY["vocab_size"], seed=1)
    hidden, qsl = run_packed(loaded, prompts)
    cls_rows = jnp.asarray(hidden[qsl[: len(prompts)]])  # [R, H]
    logits = loaded.module.apply({"params": loaded.params}, cls_rows, method="classify")
    assert logits.shape == (len(prompts), 3) and logits.dtype == jnp.float32
    ref = np.stack([hf_forward(hf, ids).logits[0].numpy() for ids in prompts])
    np.testing.assert_allclose(np.asarray(logits), ref, atol=1e-4, rtol=0)


def test_padding_and_neighbours_do_not_leak(tiny_berts):
    """A request's rows do not depend on the padding's tokens, the bucket, or the
    other requests of the batch."""
    _, loaded = tiny_berts["BertModel"]
    prompts = prompts_of(LENGTHS, TINY["vocab_size"], seed=2)
    hidden, qsl = run_packed(loaded, prompts)
    other, other_qsl = run_packed(loaded, prompts, num_tokens=48, num_reqs=8, pad_token=77)
    np.testing.assert_allclose(hidden[: qsl[4]], other[: other_qsl[4]], atol=1e-6)
    alone, _ = run_packed(loaded, prompts[2:3], num_tokens=16, num_reqs=1)
    np.testing.assert_allclose(alone[: LENGTHS[2]], hidden[qsl[2] : qsl[3]], atol=1e-5)


def test_checkpoint_names():
    from jaxengine.models.bert import BertForSequenceClassification, BertModel

    encoder, classifier = BertModel.hf_param_path, BertForSequenceClassification.hf_param_path
    name = "encoder.layer.3.attention.self.query.weight"
    path = ("encoder", "layer_3", "attention", "self", "query", "weight")
    assert encoder(name) == encoder("bert." + name) == (path, None)
    assert classifier(name) == classifier("bert." + name) == (("bert", *path), None)
    assert encoder("encoder.layer.0.output.LayerNorm.gamma")[0][-1] == "weight"
    for skipped in ("pooler.dense.weight", "embeddings.position_ids", "cls.predictions.bias"):
        assert encoder(skipped) is None
    assert classifier("bert.pooler.dense.bias") == (("bert", "pooler", "dense", "bias"), None)
    assert classifier("classifier.weight") == (("classifier", "weight"), None)


def test_missing_or_unknown_tensors_are_named(tiny_berts, tmp_path):
    _, loaded = tiny_berts["BertForSequenceClassification"]
    module, config = loaded.module, loaded.config
    tensors = list(iter_safetensors(loaded.source.path))
    assert checkpoint_names(module) == type(module).hf_param_path
    kept = [(n, a) for n, a in tensors if n != "classifier.bias"]
    with pytest.raises(CheckpointError, match="classifier/bias"):
        params_from_tensors(module, config, kept, "test")
    with pytest.raises(CheckpointError, match="'bert.extra.weight' has no place"):
        params_from_tensors(module, config, [*tensors, ("bert.extra.weight", tensors[0][1])], "t")


def test_dummy_load_runs(tiny_berts):
    _, loaded = tiny_berts["BertForSequenceClassification"]
    model = ModelConfig(model=str(loaded.source.path), dtype="float32")
    dummy = load_model(model, LoadConfig(load_format="dummy"))
    shapes = {k: v.shape for k, v in _flat(loaded.params).items()}
    assert {k: v.shape for k, v in _flat(dummy.params).items()} == shapes
    hidden, _ = run_packed(dummy, prompts_of(LENGTHS, TINY["vocab_size"]))
    assert np.isfinite(hidden).all()
    ln = dummy.params["bert"]["embeddings"]["LayerNorm"]
    assert float(ln["weight"].min()) == 1.0 and float(jnp.abs(ln["bias"]).max()) == 0.0


def _flat(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


SENTENCES = (
    "Hello world.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "JAX compiles numerical programs with XLA, and Flax builds neural networks on it.",
)


def test_minilm_matches_transformers(minilm_dir):
    """The demo by name (resolved to its cached folder) against transformers' AutoModel."""
    loaded = load_model(ModelConfig(model="all-MiniLM-L6-v2", dtype="float32"), LoadConfig())
    assert loaded.source.kind == "demo" and loaded.source.path == minilm_dir
    assert type(loaded.module).__name__ == "BertModel"
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    prompts = [tokenizer(s)["input_ids"] for s in SENTENCES]
    assert len({len(p) for p in prompts}) == len(prompts)
    hidden, qsl = run_packed(loaded, prompts, num_tokens=64, num_reqs=4)
    reference_threads()
    hf = transformers.AutoModel.from_pretrained(minilm_dir, dtype=torch.float32).eval()
    for r, ids in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).last_hidden_state[0].numpy()
        np.testing.assert_allclose(hidden[qsl[r] : qsl[r + 1]], ref, atol=1e-4, rtol=0)


def test_bfloat16_on_cpu_keeps_float32_activations(tiny_berts, tmp_path):
    """``--dtype bfloat16`` on CPU: the projections are bfloat16 weights whose dots
    take bfloat16 inputs and accumulate in float32 (`loader.cpu_dtypes`); embeddings,
    norms and activations stay float32, so the hidden states stay near transformers'
    float32 ones (each row's cosine >= 0.999)."""
    from jaxengine.models.layers.basic import Linear

    hf, _ = tiny_berts["BertModel"]
    hf.save_pretrained(tmp_path)
    loaded = load_model(ModelConfig(model=str(tmp_path), dtype="bfloat16"), LoadConfig())
    assert (loaded.config.dtype, loaded.config.matmul_dtype) == (jnp.float32, jnp.bfloat16)
    layer = loaded.params["encoder"]["layer_0"]
    assert layer["attention"]["self"]["query"]["weight"].dtype == jnp.bfloat16
    assert layer["attention"]["output"]["LayerNorm"]["weight"].dtype == jnp.float32
    assert loaded.params["embeddings"]["word_embeddings"]["weight"].dtype == jnp.float32
    prompts = prompts_of(LENGTHS, TINY["vocab_size"], seed=3)
    hidden, qsl = run_packed(loaded, prompts)
    assert hidden.dtype == np.float32
    for r, ids in enumerate(prompts):
        ref = hf_forward(hf, ids).hidden_states[-1][0].numpy()
        got = hidden[qsl[r] : qsl[r + 1]]
        cos = np.sum(got * ref, -1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(ref, axis=-1)
        assert cos.min() >= 0.999
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 16)), jnp.float32)
    dense = Linear(8, ("mlp", "embed"), dtype=jnp.float32, weight_dtype=jnp.bfloat16)
    variables = nn.unbox(dense.init(jax.random.key(0), x))
    weight = variables["params"]["weight"]
    assert weight.dtype == jnp.bfloat16
    want = np.asarray(x.astype(jnp.bfloat16), np.float32) @ np.asarray(weight, np.float32).T
    got = dense.apply(variables, x)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
