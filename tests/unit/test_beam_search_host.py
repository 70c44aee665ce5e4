"""Beam search's host algorithm (`jaxengine.beam_search`) with fake scorers, no engine.

vLLM's docs (`vllm.beam_search.BeamSearchOutput`): "The output of beam search. It
contains the list of the best beam search sequences. The length of the list is equal
to the beam width." (`LLM.beam_search(prompts, BeamSearchParams(beam_width, ...))`).
The selection rules are transformers' (``generate(num_beams=..., length_penalty=...,
early_stopping=...)``): the table scorers below pin each rule on a hand-computed
case, and a tiny random transformers model checks the whole algorithm against
``generate`` itself over every early-stopping mode and several length penalties.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from jaxengine.beam_search import (
    BeamSearch,
    BeamSearchParams,
    check_engine,
    eos_token_ids,
    run_beam_searches,
)
from jaxengine.outputs import Logprob
from tests.models.hf_reference import hf_beam_search

EOS, A, B, C = 2, 10, 11, 12
PROMPT = [100, 101]
DEFAULT = {A: -0.05, B: -3.0, C: -4.0, EOS: -5.0}


def dist(**logprobs: float) -> dict[int, Logprob]:
    names = {"EOS": EOS, "A": A, "B": B, "C": C}
    ordered = sorted(logprobs.items(), key=lambda kv: -kv[1])
    return {names[n]: Logprob(v, rank) for rank, (n, v) in enumerate(ordered, start=1)}


def table_search(table: dict[tuple, dict], params: BeamSearchParams, eos=(EOS,)):
    """Runs one search whose next-token logprobs come from ``table`` (generated
    tokens -> distribution; DEFAULT for prefixes it does not name)."""
    search = BeamSearch(PROMPT, params, eos)
    seen = []

    def score(batch):
        out = []
        for owner, ids in batch:
            assert owner is search and ids[: len(PROMPT)] == PROMPT
            generated = tuple(ids[len(PROMPT) :])
            seen.append(generated)
            entries = table.get(generated)
            out.append(entries if entries is not None else dist_of(DEFAULT))
        return out

    run_beam_searches([search], score)
    return search.output(), seen


def dist_of(mapping: dict[int, float]) -> dict[int, Logprob]:
    ordered = sorted(mapping.items(), key=lambda kv: -kv[1])
    return {t: Logprob(v, r) for r, (t, v) in enumerate(ordered, start=1)}


def generated(out) -> list[list[int]]:
    return [seq.tokens[len(PROMPT) :] for seq in out.sequences]


# --------------------------------------------------------------------- EOS handling


EOS_RANK = {
    (): dist(A=-0.1, EOS=-0.2, B=-3.0, C=-4.0),
    (A,): dist(B=-0.5, EOS=-2.0, C=-3.0, A=-4.0),
    (A, B): dist(EOS=-0.1, C=-1.0, A=-5.0, B=-6.0),
}


def test_eos_beyond_rank_beam_width_is_dropped():
    """transformers keeps the top 2 * num_beams candidates, but only those among the
    first num_beams may finish: with one beam, step 1's EOS (rank 2, a better score
    than the final answer) is dropped, and so is [A, EOS] at step 2."""
    params = BeamSearchParams(beam_width=1, max_tokens=3, length_penalty=1.0)
    out, seen = table_search(EOS_RANK, params)
    assert generated(out) == [[A, B]]
    (seq,) = out.sequences
    assert seq.finish_reason == "stop"
    assert seq.cum_logprob == pytest.approx(-0.1 - 0.5 - 0.1)
    assert seen == [(), (A,), (A, B)]  # one live beam per step
    assert len(seq.logprobs) == 2 and B in seq.logprobs[1]


def test_eos_within_rank_beam_width_finishes_a_hypothesis():
    """With two beams the same EOS is rank 2 of 4: it finishes, and wins (score -0.2
    against [A, B, ...]'s)."""
    params = BeamSearchParams(beam_width=2, max_tokens=3, early_stopping=True)
    out, _ = table_search(EOS_RANK, params)
    assert generated(out)[0] == []
    assert out.sequences[0].finish_reason == "stop"
    assert out.sequences[0].cum_logprob == pytest.approx(-0.2)


def test_include_stop_str_in_output_keeps_the_eos_token_and_its_logprobs():
    params = BeamSearchParams(beam_width=1, max_tokens=3, include_stop_str_in_output=True)
    out, _ = table_search(EOS_RANK, params)
    (seq,) = out.sequences
    assert seq.tokens == [*PROMPT, A, B, EOS]
    assert len(seq.logprobs) == 3 and seq.logprobs[2][EOS].logprob == -0.1


def test_ignore_eos_makes_eos_an_ordinary_token():
    params = BeamSearchParams(beam_width=1, max_tokens=3, ignore_eos=True)
    out, _ = table_search(EOS_RANK, params)
    (seq,) = out.sequences
    assert seq.tokens[len(PROMPT) :] == [A, B, EOS]
    assert seq.finish_reason == "length"


def test_several_eos_ids_widen_the_candidates_and_all_end_beams():
    """transformers keeps max(2, 1 + #EOS) * num_beams candidates."""
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    assert BeamSearch(PROMPT, params, {EOS}).num_candidates == 4
    assert BeamSearch(PROMPT, params, {EOS, C}).num_candidates == 6
    assert BeamSearch(PROMPT, params, set()).num_candidates == 4
    ignoring = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    assert BeamSearch(PROMPT, ignoring, {EOS, C}).num_candidates == 4
    out, _ = table_search({(): dist(C=-0.1, A=-0.2, B=-3.0, EOS=-4.0)}, params, eos=(EOS, C))
    ended = [s for s in out.sequences if s.tokens == PROMPT]  # ended on C at step 1
    assert len(ended) == 1 and ended[0].finish_reason == "stop"


# --------------------------------------------------------------------- length penalty


LENGTHS = {
    (): dist(A=-0.5, EOS=-1.0, B=-2.0, C=-3.0),
    (A,): dist(A=-0.1, EOS=-3.0, B=-4.0, C=-5.0),
    (B,): dist(C=-0.1, A=-3.0, B=-4.0, EOS=-5.0),
    (A, A): dist(EOS=-0.9, A=-2.0, B=-3.0, C=-4.0),
    (B, C): dist(A=-0.2, B=-3.0, C=-4.0, EOS=-4.5),
}


@pytest.mark.parametrize(
    "length_penalty, first",
    [(0.0, []), (1.0, [A, A]), (2.0, [A, A]), (-1.0, [])],
)
def test_length_penalty_divides_by_the_generated_length_with_eos(length_penalty, first):
    """[EOS] (sum -1.0, 1 token) against [A, A, EOS] (sum -1.5, 3 tokens counting the
    EOS): score = sum / len ** length_penalty, so 0 prefers the short one and 1 the
    long one (-0.5), as transformers' beam scorer does."""
    params = BeamSearchParams(
        beam_width=2, max_tokens=4, length_penalty=length_penalty, early_stopping=True
    )
    out, _ = table_search(LENGTHS, params)
    assert sorted(map(tuple, generated(out))) == [(), (A, A)]
    assert generated(out)[0] == first
    cums = {tuple(t): s.cum_logprob for t, s in zip(generated(out), out.sequences, strict=True)}
    assert cums[()] == pytest.approx(-1.0) and cums[(A, A)] == pytest.approx(-1.5)


# --------------------------------------------------------------------- early stopping


STOPPING = {
    (): dist(A=-0.1, EOS=-0.5, B=-0.7, C=-3.0),
    (A,): dist(EOS=-0.2, A=-0.3, B=-4.0, C=-5.0),
    (B,): dist(A=-2.0, B=-3.0, C=-4.0, EOS=-5.0),
    (A, A): dist(EOS=-0.02, A=-0.06, B=-4.0, C=-5.0),
}


@pytest.mark.parametrize(
    "early_stopping, expected, steps",
    [
        # stops as soon as num_beams hypotheses exist
        (True, [[A], []], 2),
        # goes on while the best live beam's score at its current length beats the
        # worst hypothesis: [A, A] (-0.4 / 2) beats [EOS] (-0.5), [A, A, A] does not
        (False, [[A, A], [A]], 3),
        # with length_penalty > 0 a live beam is measured at max_tokens: it always
        # might improve here, so the search runs to max_tokens and the unfinished
        # beams become hypotheses ("length")
        ("never", [[A] * 5, [A, A]], 5),
    ],
)
def test_early_stopping_modes(early_stopping, expected, steps):
    params = BeamSearchParams(
        beam_width=2, max_tokens=5, length_penalty=1.0, early_stopping=early_stopping
    )
    out, seen = table_search(STOPPING, params)
    assert generated(out) == expected
    assert max(len(s) for s in seen) + 1 == steps
    reasons = [s.finish_reason for s in out.sequences]
    assert reasons == (["length", "stop"] if early_stopping == "never" else ["stop", "stop"])


def test_max_tokens_turns_the_best_unfinished_beams_into_hypotheses():
    """No EOS ever: the search runs max_tokens steps and returns the best beams."""
    params = BeamSearchParams(beam_width=3, max_tokens=4)
    out, seen = table_search({}, params)
    assert len(out.sequences) == 3
    assert generated(out)[0] == [A] * 4
    assert all(s.finish_reason == "length" for s in out.sequences)
    assert len({tuple(t) for t in generated(out)}) == 3
    assert max(len(s) for s in seen) == 3
    scores = [s.cum_logprob for s in out.sequences]
    assert scores == sorted(scores, reverse=True)


# --------------------------------------------------------------------- plumbing


def test_run_beam_searches_batches_every_live_beam_of_every_search():
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    searches = [BeamSearch([1], params, {EOS}), BeamSearch([1, 2, 3], params, {EOS})]
    sizes = []

    def score(batch):
        sizes.append(len(batch))
        return [dist_of(DEFAULT) for _ in batch]

    run_beam_searches(searches, score)
    assert sizes == [2, 4, 4]
    assert all(s.finished for s in searches)
    for search in searches:
        assert [len(seq.tokens) - len(search.prompt) for seq in search.output().sequences] == [3, 3]


def test_step_params_and_request_output():
    params = BeamSearchParams(beam_width=2, max_tokens=3, temperature=0.5)
    search = BeamSearch(PROMPT, params, {EOS})
    step = search.step_params()
    assert (step.max_tokens, step.logprobs, step.temperature) == (1, 4, 0.5)
    assert search.step_params(logprobs=7).logprobs == 7
    run_beam_searches([search], lambda batch: [table_entry(ids) for _, ids in batch])
    out = search.request_output("r", "prompt", lambda ids: ",".join(map(str, ids)), True)
    assert out.finished and out.prompt_token_ids == PROMPT and out.prompt == "prompt"
    assert [o.index for o in out.outputs] == [0, 1]
    best = out.outputs[0]
    assert list(best.token_ids) == [A, A] and best.text == f"{A},{A}"
    assert len(best.logprobs) == 2  # aligned with the tokens (the EOS dropped, as vLLM)
    assert best.finish_reason == "stop"
    assert best.cumulative_logprob == pytest.approx(-0.05 - 0.05 - 0.01)
    kept = BeamSearchParams(beam_width=2, max_tokens=3, include_stop_str_in_output=True)
    search = BeamSearch(PROMPT, kept, {EOS})
    run_beam_searches([search], lambda batch: [table_entry(ids) for _, ids in batch])
    best = search.request_output("r", None, lambda ids: ",".join(map(str, ids)), False).outputs[0]
    assert list(best.token_ids) == [A, A, EOS]  # the EOS token is an output token ...
    assert best.text == f"{A},{A}" and best.logprobs is None  # ... but not text


def table_entry(ids):
    return {(*PROMPT, A, A): dist_of({EOS: -0.01, A: -0.5, B: -6.0, C: -7.0})}.get(
        tuple(ids), dist_of(DEFAULT)
    )


def test_params_are_validated():
    for bad in (
        dict(beam_width=0, max_tokens=1),
        dict(beam_width=True, max_tokens=1),
        dict(beam_width=2, max_tokens=0),
        dict(beam_width=2, max_tokens=3, temperature=-1.0),
        dict(beam_width=2, max_tokens=3, early_stopping="sometimes"),
    ):
        with pytest.raises(ValueError):
            BeamSearchParams(**bad)


def test_the_engine_must_return_enough_log_probabilities():
    search = BeamSearch(PROMPT, BeamSearchParams(beam_width=11, max_tokens=2), {EOS})

    def config(max_logprobs, mode="raw_logprobs"):
        return SimpleNamespace(max_logprobs=max_logprobs, logprobs_mode=mode)

    with pytest.raises(ValueError, match="22 candidates per beam.*max_logprobs \\(20\\)"):
        check_engine(search, config(20))
    check_engine(search, config(22))
    check_engine(search, config(-1))
    check_engine(search, config(22, "processed_logprobs"))
    with pytest.raises(ValueError, match="raw_logits returns logits"):
        check_engine(search, config(22, "raw_logits"))


def test_eos_ids_come_from_the_model_and_its_generation_config():
    assert eos_token_ids(2, None) == {2}
    assert eos_token_ids(2, {"eos_token_id": [2, 7]}) == {2, 7}
    assert eos_token_ids(None, {"eos_token_id": 5}) == {5}


def test_the_module_leaves_jax_out():
    """Host code does not import JAX (STYLE 1)."""
    code = (
        "import sys, jaxengine.beam_search\n"
        "print([m for m in ('jax', 'jaxlib', 'torch') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------- transformers


EOS_TINY, VOCAB = 3, 24


@pytest.fixture(scope="module")
def tiny_models():
    """Tiny random Llamas whose next-token distributions are peaked (scaled LM head),
    so beams differ by clear margins rather than float32 rounding."""
    import torch
    import transformers

    models = []
    for seed in range(3):
        torch.manual_seed(seed)
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
            bos_token_id=1, eos_token_id=EOS_TINY, pad_token_id=EOS_TINY,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(40.0)
            # EOS among the candidates at most steps: over these cases about 70% of the
            # returned beams end on EOS, a fifth of the searches stop early, and the
            # early-stopping mode changes the answer in several of them
            model.lm_head.weight[EOS_TINY] *= 1.5
        models.append(model)
    return models


def tiny_scorer(model, num_logprobs):
    import torch

    def score(batch):
        out = []
        with torch.no_grad():
            for _, ids in batch:
                logits = model(torch.tensor([ids])).logits[0, -1].float()
                logprobs = torch.log_softmax(logits, dim=-1)
                values, tokens = torch.topk(logprobs, num_logprobs)
                out.append(
                    {
                        int(t): Logprob(float(v), r)
                        for r, (t, v) in enumerate(zip(tokens, values, strict=True), start=1)
                    }
                )
        return out

    return score


@pytest.mark.parametrize("early_stopping", [False, True, "never"])
@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0, -0.5])
@pytest.mark.parametrize("width", [2, 3])
def test_same_beams_and_scores_as_transformers(tiny_models, width, length_penalty, early_stopping):
    """`transformers.generate(num_beams=width, num_return_sequences=width, ...)`
    returns the same sequences, in the same order, with the same scores."""
    params = BeamSearchParams(
        beam_width=width,
        max_tokens=7,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        include_stop_str_in_output=True,
    )
    for i, model in enumerate(tiny_models):
        prompt = [1, 5 + i, 9, 4 + 2 * i]
        search = BeamSearch(prompt, params, {EOS_TINY})
        run_beam_searches([search], tiny_scorer(model, search.num_candidates))
        ours = [seq.tokens[len(prompt) :] for seq in search.output().sequences]
        expected, scores = hf_beam_search(
            model, prompt, width, 7, length_penalty, early_stopping, EOS_TINY
        )
        assert ours == expected, f"model {i}"
        mine = [h.score for h in search._hypotheses]
        assert mine == pytest.approx(scores, rel=1e-5, abs=1e-5)
