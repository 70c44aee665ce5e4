"""The on-device sampler against a numpy re-implementation of vLLM's definitions.

Every random check uses fixed seeds, so the tests are deterministic.
"""

from __future__ import annotations

import math
from dataclasses import replace

import jax
import numpy as np
import pytest

from jaxengine.runner import sampler
from jaxengine.runner.sampler import (
    apply_token_bitmask,
    filter_logits,
    process_logits,
    prompt_logprobs_jit,
    sample_jit,
)
from jaxengine.runner.sampler_functions import sampler_variants
from jaxengine.runner.sampling_metadata import (
    SamplerFlags,
    SamplingBatch,
    SamplingRow,
    apply_logits_processors,
    build_sampling_metadata,
    pick_variant,
    request_seed,
)
from jaxengine.sampling_params import SamplingParams

V = 16


def _logits(rows: int, vocab: int = V, seed: int = 0, scale: float = 2.0) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=(rows, vocab)) * scale).astype(np.float32)


def _row(out=(), prompt=(1, 2), seed=0, **kw) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), list(out), list(prompt), seed=seed)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


# ------------------------------------------------------------- numpy reference


def _ref_filter(x: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Temperature, min-p, top-k, top-p on one row, as vLLM defines them."""
    x = x.astype(np.float64) / p.temperature
    probs = np.exp(_log_softmax(x))
    x = np.where(probs < p.min_p * probs.max(), -np.inf, x)
    if p.top_k:
        x = np.where(x < np.sort(x)[::-1][p.top_k - 1], -np.inf, x)
    if p.top_p < 1:
        order = np.argsort(-x, kind="stable")
        probs = np.exp(_log_softmax(x))[order]
        drop = (np.cumsum(probs) - probs) >= p.top_p
        drop[0] = False
        x[order[drop]] = -np.inf
    return x


def _ref_penalties(x: np.ndarray, p: SamplingParams, out, prompt) -> np.ndarray:
    x = x.astype(np.float64).copy()
    counts = np.bincount(np.asarray(out, int), minlength=x.size)
    seen = (counts > 0) | (np.bincount(np.asarray(prompt, int), minlength=x.size) > 0)
    r = p.repetition_penalty
    x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def _chi2_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty chi-square quantile; z = 3.719 is the 1e-4 upper tail."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


# ----------------------------------------------------------------------- tests


def test_greedy_is_argmax_and_padding_is_finite() -> None:
    logits = _logits(4)
    logits[3] = 0.0  # a padding slot's logits
    rows = [_row(temperature=0.0), _row(temperature=0.0, logprobs=2)]
    md, flags = build_sampling_metadata(rows, 4, V)
    assert flags.all_greedy and flags.num_logprobs == 5
    out = sample_jit(logits, md, flags=flags)
    np.testing.assert_array_equal(out.token_ids, logits.argmax(-1))
    for leaf in jax.tree.leaves(out.logprobs):
        assert np.all(np.isfinite(np.asarray(leaf)))


def test_seeded_draws_ignore_batch_composition() -> None:
    base = _logits(1, vocab=64, seed=1)[0]
    target = dict(temperature=0.9, top_k=20, top_p=0.9, seed=1234)

    def token_of_target(position: int, neighbours: list[SamplingRow], slots: int) -> int:
        rows: list[SamplingRow | None] = list(neighbours)
        rows.insert(position, SamplingRow(SamplingParams(**target), [5] * 3, [1], seed=1234))
        logits = _logits(slots, vocab=64, seed=9)
        logits[position] = base
        md, flags = build_sampling_metadata(rows, slots, 64)
        return int(sample_jit(logits, md, flags=flags).token_ids[position])

    tokens = {
        token_of_target(0, [], 1),
        token_of_target(0, [_row(temperature=0.5, seed=7)], 4),
        token_of_target(2, [_row(temperature=0.0), _row(top_p=0.5, seed=8)], 4),
        token_of_target(5, [_row(seed=i, min_p=0.1, logprobs=3) for i in range(6)], 8),
    }
    assert len(tokens) == 1
    # Another step of the same request draws with a different key.
    steps = set()
    for n_out in range(8):
        row = SamplingRow(SamplingParams(temperature=5.0, seed=1234), [5] * n_out, [1], 1234)
        md, flags = build_sampling_metadata([row], 1, 64)
        steps.add(int(sample_jit(base[None], md, flags=flags).token_ids[0]))
    assert len(steps) > 1


def test_unseeded_requests_get_distinct_reproducible_seeds() -> None:
    p = SamplingParams()
    assert request_seed(p, 0, 1) == request_seed(p, 0, 1)
    assert len({request_seed(p, s, c) for s in range(3) for c in range(50)}) == 150
    assert request_seed(SamplingParams(seed=42), 0, 1) == 42


CASES = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.9, min_p=0.15),
    dict(temperature=1.1, top_k=8, top_p=0.9, min_p=0.1),
]


@pytest.mark.parametrize("kwargs", CASES, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_empirical_distribution_matches_filtered_softmax(kwargs: dict) -> None:
    draws = 20_000
    params = SamplingParams(**kwargs)
    row_logits = _logits(1, seed=4, scale=0.8)[0]
    md, flags = build_sampling_metadata([SamplingRow(params, [], [1], seed=99)], 1, V)
    md = jax.tree.map(lambda a: np.repeat(a, draws, axis=0), md)
    md = md._replace(rng_step=np.arange(draws, dtype=np.uint32))  # one draw per step
    logits = np.repeat(row_logits[None], draws, axis=0)
    tokens = np.asarray(sample_jit(logits, md, flags=flags).token_ids)
    counts = np.bincount(tokens, minlength=V)
    expected = np.exp(_log_softmax(_ref_filter(row_logits, params))) * draws
    assert np.all(counts[expected == 0] == 0), "a filtered-out token was sampled"
    support = expected > 0
    chi2 = np.sum((counts[support] - expected[support]) ** 2 / expected[support])
    df = int(support.sum()) - 1
    assert df >= 3  # the case keeps several tokens, so the test has power
    assert chi2 < _chi2_critical(df), (chi2, df)


def test_top_k_fast_path_equals_full_sort() -> None:
    vocab = 256
    rows = [_row(seed=i, temperature=0.8, top_k=k, top_p=p) for i, (k, p) in enumerate(
        [(5, 1.0), (12, 0.6), (1, 1.0), (16, 0.95), (0, 1.0)]
    )]  # fmt: skip
    md, flags = build_sampling_metadata(rows, 8, vocab)
    assert flags.filter_width == 16
    logits = _logits(8, vocab, seed=4)
    fast = np.asarray(filter_logits(logits, md, flags))
    full = np.asarray(filter_logits(logits, md, replace(flags, filter_width=vocab)))
    np.testing.assert_array_equal(fast, full)
    for i, row in enumerate(rows):
        ref = _ref_filter(logits[i], row.params)
        np.testing.assert_array_equal(np.isfinite(fast[i]), np.isfinite(ref))


def test_penalties_and_bias_change_logits_exactly() -> None:
    out, prompt = [3, 3, 7, 1], [7, 9, 2]
    cases = [
        dict(repetition_penalty=1.3),
        dict(frequency_penalty=0.7),
        dict(presence_penalty=-0.4),
        dict(repetition_penalty=0.8, frequency_penalty=-1.1, presence_penalty=1.5),
        dict(logit_bias={0: 3.0, 7: -2.5}),
        dict(),
    ]
    rows = [SamplingRow(SamplingParams(**kw), out, prompt, seed=0) for kw in cases]
    md, flags = build_sampling_metadata(rows, 8, V)
    logits = _logits(8)
    got = np.asarray(process_logits(logits, md, flags))
    for i, row in enumerate(rows):
        want = _ref_penalties(logits[i], row.params, out, prompt)
        for tok, b in (row.params.logit_bias or {}).items():
            want[tok] += b
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[6:], logits[6:])  # padding rows untouched


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    eos = 0
    logits = np.zeros((1, V), np.float32)
    logits[0, [eos, 5]] = 10.0  # EOS and a stop id are by far the likeliest
    for generated in range(4):
        row = _row(out=[9] * generated, temperature=0.0, min_tokens=3, stop_token_ids=[5])
        md, flags = build_sampling_metadata([row], 1, V, eos_token_id=eos)
        token = int(sample_jit(logits, md, flags=flags).token_ids[0])
        assert (token not in (eos, 5)) if generated < 3 else token in (eos, 5)


def test_allowed_token_ids_restrict_sampling() -> None:
    allowed = [2, 11, 13]
    rows = [_row(seed=i, temperature=2.0, allowed_token_ids=allowed) for i in range(32)]
    rows.append(_row(temperature=0.0, allowed_token_ids=[4]))
    md, flags = build_sampling_metadata(rows, 40, V)
    tokens = np.asarray(sample_jit(_logits(40), md, flags=flags).token_ids)
    assert set(tokens[:32].tolist()) == set(allowed) and tokens[32] == 4


def test_bad_words_single_and_multi_token() -> None:
    params = SamplingParams(temperature=0.0, bad_words=["ab", "c"])
    params._bad_words_token_ids = [[3, 4], [6]]  # as update_from_tokenizer would set
    logits = np.zeros((3, V), np.float32)
    logits[:, 4] = 10.0
    logits[:, 6] = 9.0
    rows = [
        SamplingRow(params, [1, 3], [1], 0),  # output ends with the prefix [3]: 4 banned
        SamplingRow(params, [3, 1], [1], 0),  # prefix not at the end: 4 allowed
        SamplingRow(params, [], [3], 0),  # the prompt does not count
    ]
    md, flags = build_sampling_metadata(rows, 3, V)
    tokens = np.asarray(sample_jit(logits, md, flags=flags).token_ids)
    assert tokens.tolist() == [0, 4, 4]  # 6 is always banned


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs", "raw_logits"])
def test_logprobs_and_ranks(mode: str) -> None:
    rows = [_row(seed=i, temperature=1.5, logprobs=3, top_k=6) for i in range(5)]
    rows.append(_row(temperature=0.0, logprobs=0, repetition_penalty=1.5, out=[1]))
    md, flags = build_sampling_metadata(rows, 8, V, logprobs_mode=mode)
    logits = _logits(8)
    out = sample_jit(logits, md, flags=flags)
    tokens = np.asarray(out.token_ids)
    if mode == "raw_logprobs":
        ref = _log_softmax(logits)
    elif mode == "raw_logits":
        ref = logits.astype(np.float64)
    else:
        processed = np.array(process_logits(logits, md, flags))
        final = np.array(filter_logits(processed, md, flags))
        final[5] = processed[5]  # the greedy row's logits are not temperature-scaled
        ref = _log_softmax(final)
    lp = out.logprobs
    chosen = ref[np.arange(8), tokens]
    np.testing.assert_allclose(lp.sampled_logprob, chosen, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(lp.sampled_rank, (ref >= chosen[:, None] - 1e-6).sum(-1))
    order = np.argsort(-ref, axis=-1, kind="stable")[:, :5]
    np.testing.assert_array_equal(lp.topk_ids, order)
    np.testing.assert_allclose(lp.topk_logprobs, np.take_along_axis(ref, order, 1), atol=1e-5)


def test_prompt_logprobs() -> None:
    logits, targets = _logits(6), np.array([3, 0, 15, 7, 7, 1])
    out = prompt_logprobs_jit(logits, targets, k=4)
    ref = _log_softmax(logits)
    chosen = ref[np.arange(6), targets]
    np.testing.assert_allclose(out.sampled_logprob, chosen, rtol=1e-5)
    np.testing.assert_array_equal(out.sampled_rank, (ref >= chosen[:, None]).sum(-1))
    np.testing.assert_array_equal(out.topk_ids, np.argsort(-ref, axis=-1)[:, :4])


def test_logprob_token_ids_gather() -> None:
    """`logprob_token_ids`: the named ids' logprobs and ranks (as the sampled token's),
    beside an unchanged draw and top-k, in a batch mixing them with plain rows."""
    rows = [_row(temperature=0.0, logprob_token_ids=[3, 0, 15]), _row(temperature=0.0)]
    rows += [_row(temperature=0.0, logprobs=2), None]
    batch = SamplingBatch(rows, 4, V)
    flags = batch.required_flags()
    assert flags.logprob_ids_width == 128 and flags.num_logprobs == 5
    logits = _logits(4)
    out = sample_jit(logits, batch.to_metadata(flags), flags=flags)
    plain = replace(flags, logprob_ids_width=0)
    alone = SamplingBatch([None, *rows[1:]], 4, V).to_metadata(plain)  # without the ids row
    rest = sample_jit(logits, alone, flags=plain)
    np.testing.assert_array_equal(out.token_ids, rest.token_ids)
    np.testing.assert_array_equal(out.logprobs.topk_ids, rest.logprobs.topk_ids)
    ref = _log_softmax(logits)
    ids = [3, 0, 15]
    lp = out.logprobs
    np.testing.assert_allclose(lp.ids_logprobs[0, :3], ref[0, ids], rtol=1e-5)
    np.testing.assert_array_equal(lp.ids_ranks[0, :3], [(ref[0] >= ref[0, t]).sum() for t in ids])
    np.testing.assert_array_equal(lp.topk_ids[2], np.argsort(-ref[2])[:5])


def test_larger_variant_gives_the_same_tokens() -> None:
    rows = [_row(seed=i, temperature=0.8, top_k=4, out=[i]) for i in range(3)] + [None]
    rows.append(_row(temperature=0.0, presence_penalty=0.5, out=[2, 2]))
    batch = SamplingBatch(rows, 8, V)
    needed = batch.required_flags()
    big = SamplerFlags(False, V, 64, V, 16, 5)
    assert big.covers(needed) and not needed.covers(big)
    assert pick_variant(needed, [big, needed, SamplerFlags(all_greedy=True)]) == needed
    logits = _logits(8)
    a = sample_jit(logits, batch.to_metadata(needed), flags=needed).token_ids
    b = sample_jit(logits, batch.to_metadata(big), flags=big).token_ids
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="does not cover"):
        batch.to_metadata(SamplerFlags(all_greedy=True))


def test_temperature_alone_skips_the_sort_of_the_filter_variant(monkeypatch) -> None:
    """vLLM's default request (temperature 1, no top-k/top-p) runs the precompiled
    filter variant without its sort (`lax.cond`): no top-k/top-p step runs, and it
    samples what a variant without filters samples; a top-p row in the same variant
    sorts in that step only."""
    sorts = []
    top_k_top_p = sampler.apply_top_k_top_p

    def counted(logits, top_k, top_p, width):
        jax.debug.callback(lambda: sorts.append(1))
        return top_k_top_p(logits, top_k, top_p, width)

    monkeypatch.setattr(sampler, "apply_top_k_top_p", counted)
    fresh = jax.jit(sampler.sample, static_argnames="flags")  # traced with `counted`
    variants = sampler_variants(V, max_logprobs=20, mode="raw_logprobs", max_model_len=64)
    rows = [_row(seed=i, temperature=1.0, out=[i]) for i in range(3)] + [None]
    batch = SamplingBatch([*rows, _row(seed=9, temperature=0.7, logprobs=2)], 8, V)
    picked = pick_variant(batch.required_flags(), variants)
    assert picked.filter_width == V and not picked.all_greedy
    logits = _logits(8)
    a = jax.block_until_ready(fresh(logits, batch.to_metadata(picked), flags=picked))
    assert sorts == []
    plain = replace(picked, filter_width=0)
    b = fresh(logits, batch.to_metadata(plain), flags=plain)
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    np.testing.assert_array_equal(a.logprobs.topk_ids, b.logprobs.topk_ids)
    np.testing.assert_allclose(a.logprobs.sampled_logprob, b.logprobs.sampled_logprob)
    top_p = SamplingBatch([*rows, _row(seed=9, temperature=0.7, top_p=0.5)], 8, V)
    assert picked.covers(top_p.required_flags())
    out = jax.block_until_ready(fresh(logits, top_p.to_metadata(picked), flags=picked))
    assert sorts == [1]
    kept = np.sort(_logits(8)[4] / 0.7)[::-1]
    probs = np.exp(kept - kept.max()) / np.exp(kept - kept.max()).sum()
    nucleus = np.argsort(-_logits(8)[4])[: int(np.sum(np.cumsum(probs) - probs < 0.5))]
    assert int(out.token_ids[4]) in nucleus


def test_host_logits_processors() -> None:
    two = lambda out, x: x + len(out)  # noqa: E731
    three = lambda prompt, out, x: np.where(np.arange(x.size) == prompt[0], 100.0, x)  # noqa: E731
    rows = [_row(out=[1, 2], prompt=[4], logits_processors=[two, three]), None]
    got = apply_logits_processors(np.zeros((2, V), np.float32), rows)
    assert got[0, 4] == 100.0 and got[0, 0] == 2.0 and np.all(got[1] == 0)


def _bitmask(allowed: list[set[int]], vocab: int) -> np.ndarray:
    """Rows of int32 words, bit j of word w = token 32 w + j (llguidance's layout)."""
    width = -(-vocab // 32)
    bits = np.zeros((len(allowed), width * 32), np.uint8)
    for r, tokens in enumerate(allowed):
        bits[r, sorted(tokens)] = 1
    packed = np.packbits(bits.reshape(len(allowed), width, 4, 8)[..., ::-1], axis=-1)
    return packed.reshape(len(allowed), width * 4).view("<i4").astype(np.int32)


def test_token_bitmask_masks_logits_and_sampling() -> None:
    vocab = 70  # not a multiple of 32; token 31 and 63 use bit 31 (the sign bit)
    allowed = [{0, 31, 63}, {5}, {40, 41, 69}, set(range(vocab))]
    mask = _bitmask(allowed, vocab)
    logits = _logits(4, vocab)
    masked = np.asarray(apply_token_bitmask(logits, mask))
    for r, tokens in enumerate(allowed):
        keep = np.isin(np.arange(vocab), sorted(tokens))
        assert np.array_equal(masked[r][keep], logits[r][keep])
        assert np.all(np.isneginf(masked[r][~keep]))
    rows = [
        replace(_row(seed=i, temperature=1.5), token_bitmask=mask[i % 3]) for i in range(30)
    ] + [replace(_row(temperature=0.0, logprobs=2), token_bitmask=mask[1]), _row(temperature=0.0)]
    md, flags = build_sampling_metadata(rows, 32, vocab)
    assert flags.token_bitmask and md.token_bitmask.shape == (32, 3)
    out = sample_jit(np.tile(_logits(1, vocab), (32, 1)), md, flags=flags)
    tokens = np.asarray(out.token_ids)
    assert all(int(tokens[i]) in allowed[i % 3] for i in range(30))
    assert tokens[30] == 5 and tokens[31] == int(np.argmax(_logits(1, vocab)[0]))
    assert np.isclose(float(out.logprobs.sampled_logprob[30]), 0.0)  # the one allowed token
    free = SamplingBatch([_row(temperature=0.0)], 1, vocab).required_flags()
    assert not free.token_bitmask and flags.covers(free) and not free.covers(flags)
