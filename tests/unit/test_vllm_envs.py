"""vLLM's environment variables where they mean something here (`server/envs.py`),
and ``VLLM_ALLOW_LONG_MAX_MODEL_LEN``; the live ``$VLLM_API_KEY`` check is in
tests/server/test_vllm_routes.py."""

from __future__ import annotations

import types

import pytest

from jaxengine.sampling_params import SamplingParams
from jaxengine.worker.build import resolve_max_model_len
from server import envs


def test_api_key_flag_wins_over_the_environment():
    """vLLM: "--api-key option from CLI takes precedence over VLLM_API_KEY"."""
    env = {"VLLM_API_KEY": "v", "JAXENGINE_API_KEY": "j"}
    assert envs.api_keys(["flag"], env) == ["flag"]
    assert envs.api_keys(["one", "two"], env) == ["one", "two"]  # --api-key takes several
    assert envs.api_keys(None, env) == ["j"]
    assert envs.api_keys(None, {"VLLM_API_KEY": "v"}) == ["v"]
    assert envs.api_keys(None, {"VLLM_API_KEY": ""}) == []
    assert envs.api_keys(None, {}) == []


def test_logging_and_http_variables():
    assert envs.log_stats_interval({}) == 10.0
    assert envs.log_stats_interval({"VLLM_LOG_STATS_INTERVAL": "2.5"}) == 2.5
    assert envs.log_stats_interval({"JAXENGINE_LOG_STATS_INTERVAL": "1"}) == 1.0
    assert envs.configure_logging({}) and not envs.configure_logging(
        {"VLLM_CONFIGURE_LOGGING": "0"}
    )
    assert envs.logging_level("info", {}) == "INFO"
    assert envs.logging_level("debug", {}) == "DEBUG"
    assert envs.logging_level("info", {"VLLM_LOGGING_LEVEL": "warning"}) == "WARNING"
    assert envs.logging_prefix({"VLLM_LOGGING_PREFIX": "[a] "}) == "[a] "
    assert envs.http_timeout_keep_alive({}) == 5
    assert envs.http_timeout_keep_alive({"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "30"}) == 30


HF = types.SimpleNamespace(max_position_embeddings=4096)
MODEL = types.SimpleNamespace(layers=[types.SimpleNamespace(sliding_window=None)])


def test_allow_long_max_model_len():
    """vLLM refuses a max_model_len above the model's unless
    VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 ("must be used with extreme caution")."""
    with pytest.raises(ValueError, match="VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"):
        resolve_max_model_len(5000, HF, MODEL, environ={})
    allow = {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    assert resolve_max_model_len(5000, HF, MODEL, environ=allow) == 5000
    windowed = types.SimpleNamespace(layers=[types.SimpleNamespace(sliding_window=512)])
    with pytest.raises(ValueError, match="sliding window"):  # the window still binds
        resolve_max_model_len(600, HF, windowed, True, environ=allow)


def test_logit_bias_names_every_bad_key():
    with pytest.raises(ValueError, match=r"'a', 'b'"):
        SamplingParams(logit_bias={"a": 1.0, 3: 1.0, "b": 2.0})
    with pytest.raises(ValueError, match=r"\[-1, -2\]"):
        SamplingParams(logit_bias={-1: 1.0, -2: 1.0})
