"""``max_model_len``: the model's context, or less; ``--disable-sliding-window`` caps it
at the smallest sliding window, as in vLLM."""

from __future__ import annotations

import types

import pytest

from jaxengine.worker.build import resolve_max_model_len


def _model(*windows):
    return types.SimpleNamespace(layers=[types.SimpleNamespace(sliding_window=w) for w in windows])


HF = types.SimpleNamespace(max_position_embeddings=4096)


def test_defaults_to_the_model_context():
    assert resolve_max_model_len(None, HF, _model(None, 512)) == 4096
    assert resolve_max_model_len(1000, HF, _model(None, 512)) == 1000


def test_disable_sliding_window_caps_at_the_window():
    assert resolve_max_model_len(None, HF, _model(None, 512, 1024), True) == 512
    assert resolve_max_model_len(300, HF, _model(512), True) == 300
    with pytest.raises(ValueError, match="exceeds the sliding window .* 512"):
        resolve_max_model_len(600, HF, _model(512), True)


def test_disable_sliding_window_without_a_window_changes_nothing():
    assert resolve_max_model_len(None, HF, _model(None, None), True) == 4096
    with pytest.raises(ValueError, match="maximum context length 4096"):
        resolve_max_model_len(5000, HF, _model(None), True)
