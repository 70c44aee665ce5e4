"""SamplingParams: vLLM's defaults, normalisation, validation and engine-side updates."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxengine.sampling_params import RequestOutputKind, SamplingParams, SamplingType


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.max_tokens == 16 and p.min_tokens == 0 and p.seed is None
    assert p.stop == [] and p.stop_token_ids == [] and p.bad_words == []
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.detokenize and p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert p.logit_bias is None and p.allowed_token_ids is None and p.logits_processors is None
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert p.sampling_type is SamplingType.RANDOM


def test_vllm_style_construction() -> None:
    p = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64, stop=["\n"])
    assert (p.temperature, p.top_p, p.max_tokens, p.stop) == (0.8, 0.95, 64, ["\n"])
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=["abc", "d"]).output_text_buffer_length == 2
    assert (
        SamplingParams(stop=["abc"], include_stop_str_in_output=True).output_text_buffer_length == 0
    )


def test_normalisation() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(logprobs=True).logprobs == 1
    assert SamplingParams(logit_bias={"5": 2, 7: -1.5}).logit_bias == {5: 2.0, 7: -1.5}
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA


def test_greedy_resets_filters() -> None:
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert p.sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=1e-6).temperature == 1e-2  # raised, as vLLM
    assert SamplingParams(seed=3).sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams(temperature=0, n=2).n == 2  # accepted, as vLLM


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.1}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"logprobs": -2}, "logprobs"),
        ({"prompt_logprobs": -5}, "prompt_logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["x"], "detokenize": False}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"logit_bias": {"a": 1.0}}, "logit_bias"),
        ({"logit_bias": {1: float("nan")}}, "logit_bias"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"seed": "x"}, "seed"),
    ],
)
def test_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_valid_edges() -> None:
    SamplingParams(top_p=1.0, min_p=1.0, presence_penalty=-2, frequency_penalty=2)
    SamplingParams(max_tokens=None, min_tokens=100, logprobs=-1, prompt_logprobs=0)
    SamplingParams(repetition_penalty=2.5)  # vLLM only requires > 0
    SamplingParams(truncate_prompt_tokens=-1, logit_bias={3: float("-inf")})


def test_verify_against_model() -> None:
    SamplingParams(logprobs=20, prompt_logprobs=5).verify_against(max_logprobs=20, vocab_size=100)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21).verify_against(20, 100)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1).verify_against(20, 100)
    SamplingParams(logprobs=-1).verify_against(-1, 100)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={100: 1.0}).verify_against(20, 100)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[1, 200]).verify_against(20, 100)


def test_generation_config_adds_eos() -> None:
    p = SamplingParams(stop_token_ids=[5])
    p.update_from_generation_config({"eos_token_id": [2, 9]}, model_eos_token_id=2)
    assert p.all_stop_token_ids == {2, 5, 9}
    assert sorted(p.stop_token_ids) == [5, 9]
    q = SamplingParams(ignore_eos=True)
    q.update_from_generation_config({"eos_token_id": 9}, model_eos_token_id=2)
    assert q.all_stop_token_ids == {2, 9} and q.stop_token_ids == []


class _FakeTokenizer:
    """ "hello" -> [10, 11]; " hello" -> [12, 11]; "x" -> [20]; " x" -> [20]."""

    table = {"hello": [10, 11], " hello": [12, 11], "x": [20], " x": [20]}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.table[text]


def test_bad_words_tokenized_with_and_without_space() -> None:
    p = SamplingParams(bad_words=["hello", " x"])
    assert p.bad_words_token_ids is None
    p.update_from_tokenizer(_FakeTokenizer())
    assert p.bad_words_token_ids == [[10, 11], [12, 11], [20]]
    with pytest.raises(ValueError, match="bad_words"):
        p.verify_against(20, 15)


def test_clone_is_deep_but_shares_processors() -> None:
    proc = lambda ids, logits: logits  # noqa: E731
    p = SamplingParams(stop=["a"], logits_processors=[proc], logit_bias={1: 1.0})
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("b")
    assert p.stop == ["a"]
    assert q.logits_processors[0] is proc


def test_from_optional_treats_none_as_default() -> None:
    p = SamplingParams.from_optional(temperature=None, top_p=0.5, max_tokens=None, n=None)
    assert p.temperature == 1.0 and p.top_p == 0.5 and p.max_tokens is None and p.n == 1
    with pytest.raises(TypeError):
        SamplingParams.from_optional(best_of=2)


def test_host_modules_do_not_import_jax() -> None:
    code = (
        "import sys, jaxengine.sampling_params, jaxengine.outputs, "
        "jaxengine.runner.sampling_metadata; assert 'jax' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_logprob_token_ids() -> None:
    """vLLM: logprobs "for exactly these token IDs will be returned, in addition to
    the sampled token"; at most 128 ids, all in the vocabulary, and `logprobs`, when
    set too, equal to their count."""
    p = SamplingParams(logprob_token_ids=(3, 9))
    assert p.logprob_token_ids == [3, 9] and p.logprobs is None and p.logprobs_top_k == 0
    assert SamplingParams(logprobs=2, logprob_token_ids=[3, 9]).logprobs_top_k == 0
    assert SamplingParams(logprobs=-1).logprobs_top_k == -1
    assert SamplingParams().logprobs_top_k is None
    for bad in ([], [-1], list(range(129))):
        with pytest.raises(ValueError, match="logprob_token_ids"):
            SamplingParams(logprob_token_ids=bad)
    with pytest.raises(ValueError, match="logprobs must equal"):
        SamplingParams(logprobs=1, logprob_token_ids=[3, 9])
    with pytest.raises(ValueError, match="logprob_token_ids"):
        SamplingParams(logprob_token_ids=[99, 100]).verify_against(20, 100)
