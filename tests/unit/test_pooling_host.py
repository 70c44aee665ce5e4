"""Pooling, host side: the pooler's arithmetic, the sentence-transformers files it
reads its defaults from, the flags that parse but are refused, and ``--convert
classify``'s head built from an LM head (`loader.convert`)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import transformers
from tiny_models import tiny_llama_config

from jaxengine.engine_args import EngineArgs
from jaxengine.loader.convert import as_classifier, classifier_tensors
from jaxengine.loader.errors import CheckpointError
from jaxengine.pooling_params import (
    PoolingParams,
    plain_token_ids,
    score_pairs,
    with_token_types,
)
from jaxengine.runner.pooler import PoolerSettings, activate, pool
from jaxengine.worker.pooling import is_pooling_model, sentence_transformers_pooler


def test_pool_types_dimensions_and_normalization():
    rows = np.arange(12, dtype=np.float32).reshape(4, 3)  # two requests: 1 and 3 rows
    plain = PoolingParams(normalize=False)
    for kind, want in [("LAST", rows[3]), ("CLS", rows[1]), ("MEAN", rows[1:].mean(0)),
                       ("ALL", rows[1:])]:  # fmt: skip
        first, second = pool(rows, [1, 3], [plain, plain], PoolerSettings(kind, True))
        np.testing.assert_allclose(first, rows[0] if kind != "ALL" else rows[:1])
        np.testing.assert_allclose(second, want)
    (cut,) = pool(rows[1:], [3], [PoolingParams(dimensions=2)], PoolerSettings("LAST", True))
    np.testing.assert_allclose(cut, rows[3, :2] / np.linalg.norm(rows[3, :2]))
    (tokens,) = pool(rows, [4], [PoolingParams(task="token_embed")], PoolerSettings("LAST", True))
    np.testing.assert_allclose(np.linalg.norm(tokens, axis=-1), 1.0, rtol=1e-6)


def test_sentence_transformers_files(tmp_path):
    assert sentence_transformers_pooler(tmp_path) == {}
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]  # fmt: skip
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    config = {"word_embedding_dimension": 8, "pooling_mode_cls_token": False,
              "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False}  # fmt: skip
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(config))
    assert sentence_transformers_pooler(tmp_path) == {"normalize": True, "pooling_type": "MEAN"}
    config["pooling_mode_max_tokens"] = True
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match="pooling_mode_max_tokens"):
        sentence_transformers_pooler(tmp_path)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(pooler_config={"pooling": "MEAN"}), ValueError, "unknown key"),
        (dict(pooler_config={"pooling_type": "MAX"}), ValueError, "pooling_type 'MAX'"),
        (dict(pooler_config={"dimensions": 0}), ValueError, "dimensions must be"),
        (dict(runner="draft"), NotImplementedError, "--runner draft is not supported yet"),
    ],
)
def test_flags_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        EngineArgs(**kwargs).create_engine_config()


def test_pooling_params_checks():
    with pytest.raises(ValueError, match="dimensions must be at least 1"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1 or at least 1"):
        PoolingParams(truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match="pooling task 'magic'"):
        PoolingParams(task="magic")


def test_activation_pairs_and_token_types():
    one, three = np.array([0.5]), np.array([1.0, 2.0, 3.0])
    np.testing.assert_allclose(activate(one, PoolingParams()), [1 / (1 + np.exp(-0.5))], rtol=1e-6)
    probs = activate(three, PoolingParams())
    np.testing.assert_allclose(probs, np.exp(three) / np.exp(three).sum(), rtol=1e-6)
    np.testing.assert_allclose(activate(three, PoolingParams(use_activation=False)), three)
    assert score_pairs("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert score_pairs(["x", "y"], ["a", "b"]) == [("x", "a"), ("y", "b")]
    with pytest.raises(ValueError, match="at least one text"):
        score_pairs("q", [])
    ids = with_token_types([101, 7, 102, 9, 102], [0, 0, 0, 1, 1])
    assert ids[3] == 9 | (1 << 30) and plain_token_ids(ids) == [101, 7, 102, 9, 102]


def _converted(tensors, **config):
    hf = as_classifier(transformers.LlamaConfig(architectures=["LlamaForCausalLM"], **config))
    ids = {"no": 1, "yes": 3, "maybe": 0}
    out = dict(classifier_tensors(tensors, hf, lambda ts: [ids.get(t) for t in ts], "ckpt"))
    return hf, out


def test_convert_classify_heads():
    head = np.arange(12, dtype=np.float32).reshape(4, 3)  # 4 tokens, hidden 3
    embed = np.ones((4, 3), np.float32)
    tensors = [("model.embed_tokens.weight", embed), ("lm_head.weight", head)]
    hf, out = _converted(tensors, classifier_from_token=["no", "yes"], method="from_2_way_softmax")
    assert hf.architectures == ["LlamaForSequenceClassification"] and hf.num_labels == 1
    np.testing.assert_array_equal(out["score.weight"], head[[3]] - head[[1]])
    assert "lm_head.weight" not in out  # a classifier has no LM head
    tied = dict(tie_word_embeddings=True, method="no_post_processing")
    hf, out = _converted(tensors, classifier_from_token=["yes", "maybe"], **tied)
    assert hf.num_labels == 2
    np.testing.assert_array_equal(out["score.weight"], embed[[3, 0]])
    with pytest.raises(CheckpointError, match="no score.weight.*classifier_from_token"):
        _converted(tensors)
    with pytest.raises(ValueError, match="'never' is not a token"):
        _converted(tensors, classifier_from_token=["never"], method="no_post_processing")
    with pytest.raises(ValueError, match="from_2_way_softmax takes two tokens"):
        _converted(tensors, classifier_from_token=["yes"], is_original_qwen3_reranker=True)
    with pytest.raises(ValueError, match="go together"):
        _converted(tensors, classifier_from_token=["yes"])
    # a config with no architectures (a GGUF file's) is named by its model_type
    assert as_classifier(transformers.LlamaConfig()).architectures == [
        "LlamaForSequenceClassification"
    ]


def test_pooling_models_are_told_before_they_load(minilm_dir, tmp_path):
    """The engine's defaults fit a pooling model (`platform_engine_config`): an
    encoder checkpoint, or a --runner / --convert that makes one; not a generator."""
    transformers.LlamaForCausalLM(tiny_llama_config(64)).save_pretrained(tmp_path)
    assert is_pooling_model(EngineArgs(model=str(minilm_dir)))
    assert not is_pooling_model(EngineArgs(model=str(tmp_path)))
    assert is_pooling_model(EngineArgs(model=str(tmp_path), convert="reward"))
    assert not is_pooling_model(EngineArgs(model=str(tmp_path / "missing")))


def test_the_deprecated_task_flag_names_a_runner_and_a_conversion():
    """vLLM's older ``--task``: its runner and conversion, refused beside theirs."""
    for task, want in [("embed", ("pooling", "embed")), ("embedding", ("pooling", "embed")),
                       ("score", ("pooling", "classify")), ("reward", ("pooling", "reward")),
                       ("generate", ("generate", "auto"))]:  # fmt: skip
        mc = EngineArgs(task=task).create_engine_config().model_config
        assert (mc.runner_type, mc.convert_type) == want
    assert is_pooling_model(EngineArgs(task="classify"))
    with pytest.raises(ValueError, match="cannot be combined with --runner or --convert"):
        EngineArgs(task="embed", convert="embed")
    with pytest.raises(NotImplementedError, match="--task transcription is not supported"):
        EngineArgs(task="transcription").create_engine_config()
