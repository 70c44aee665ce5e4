"""Gated DeltaNet's kernels on the state pool (`reference.gated_delta_rule`'s form):
rows out of order, fresh requests, requests without a row (first, in the middle, the
padding) and rows no request names, in interpret mode (TPU interpret mode's race
detector too) against the reference's gather, rule and scatter; and the DMA write of
a pool's rows (`rows.write_rows`, the convolution windows' on TPU) against
`reference.write_rows`, interpreted and lowered for TPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.gated_delta import reference, rows, tpu
from tests.kernels.ragged_batches import jitted, lowers_for
from tests.kernels.test_gated_delta import (
    MIXED,
    POOL_KERNELS,
    args_of,
    assert_close,
    ragged_batch,
)


def pooled(batch: dict, spare: int = 3, fresh=(1,), no_row=(), seed=0) -> dict:
    """``batch`` in the pool form: its real requests' initial states at rows of a
    pool of ``R + spare`` rows, out of order (the other rows random too); padding
    requests and those in ``no_row`` get row -1; those in ``fresh`` start from zeros."""
    rng = np.random.default_rng(seed)
    init, num_seqs = batch["initial_state"], int(batch["num_seqs"])
    num_reqs = init.shape[0]
    pool = (0.3 * rng.standard_normal((num_reqs + spare, *init.shape[1:]))).astype(np.float32)
    rows = rng.permutation(num_reqs + spare)[:num_reqs].astype(np.int32)
    pool[rows[:num_seqs]] = init[:num_seqs]
    rows[num_seqs:] = -1
    rows[list(no_row)] = -1
    is_fresh = np.isin(np.arange(num_reqs), fresh)
    return dict(batch, state_pool=pool, state_rows=rows, fresh=is_fresh)


def pool_args_of(batch: dict, dtype=jnp.float32) -> tuple:
    """A `pooled` batch's arguments of the pool form."""
    pool = (batch["state_pool"], batch["state_rows"], batch["fresh"])
    return args_of(batch, dtype)[:-1] + tuple(jnp.asarray(x) for x in pool)


POOL_CASES = {
    "mixed": dict(lens=MIXED, pad_reqs=2, fresh=(1,)),
    "decodes": dict(lens=[1] * 5, pad_reqs=2, fresh=(0, 3)),
    # a request with tokens but no row first (no live row before it) and in the middle
    "rowless": dict(lens=[3, 1, 9, 2], pad_reqs=1, fresh=(), no_row=(0, 2)),
}


@pytest.mark.parametrize("platform", sorted(POOL_KERNELS))
@pytest.mark.parametrize("case", sorted(POOL_CASES))
def test_kernel_updates_pool_rows(platform, case):
    """The pool form: each live request starts from its row (zeros if fresh) and ends
    there, as the reference's gather and scatter say; every other row is unchanged."""
    shape = dict(POOL_CASES[case])
    options = {k: shape.pop(k) for k in ("fresh", "no_row") if k in shape}
    batch = pooled(ragged_batch(**shape, seed=len(case)), seed=len(case), **options)
    args = pool_args_of(batch)
    want_out, want_pool = jitted(reference.gated_delta_rule)(*args)
    out, pool = jitted(POOL_KERNELS[platform], interpret=True)(*args)
    assert_close(out, want_out)
    assert_close(pool, want_pool)
    live = np.asarray(reference.live_requests(args[8], args[6]))
    untouched = np.setdiff1d(np.arange(len(pool)), batch["state_rows"][live])
    np.testing.assert_array_equal(np.asarray(pool)[untouched], batch["state_pool"][untouched])


def test_reference_pool_form_is_gather_rule_scatter():
    """`reference.gated_delta_rule` on a pool: the rule on the gathered states (zeros
    for a fresh request or one without a row), final states scattered to live rows."""
    batch = pooled(ragged_batch([4, 1, 7], pad_reqs=1, seed=3), fresh=(1,), no_row=(2,))
    out, pool = jitted(reference.gated_delta_rule)(*pool_args_of(batch))
    rows = batch["state_rows"]
    initial = np.where(
        ((rows >= 0) & ~batch["fresh"])[:, None, None, None], batch["state_pool"][rows], 0.0
    )
    want_out, final = jitted(reference.gated_delta_states)(*args_of(batch)[:-1], initial)
    assert_close(out, want_out)
    want_pool = batch["state_pool"].copy()
    want_pool[rows[:2]] = np.asarray(final)[:2]  # requests 0 and 1 own rows
    np.testing.assert_array_equal(np.asarray(pool), want_pool)


def test_tpu_kernel_has_no_races():
    """TPU interpret mode's race detector, with eager copies and two cores sharing the
    head blocks: no copy meets an unordered read or write. (It reports the output
    copies of a request's last chunk when the kernel does not wait for them before
    the next request writes over the same rows.)"""
    # private: where interpret mode keeps what its race detector found (jax 0.10)
    simulator = pytest.importorskip("jax._src.pallas.mosaic.interpret.interpret_pallas_call")
    params = pltpu.InterpretParams(
        detect_races=True, dma_execution_mode="eager", num_cores_or_threads=2
    )
    batch = pooled(ragged_batch([20, 9, 1, 3], hk=2, hv=4, seed=10), fresh=(2,))
    got = tpu.gated_delta_rule(
        *pool_args_of(batch), chunk_size=8, key_heads_per_block=1, interpret=params
    )
    assert not simulator.races.races_found
    want = jitted(reference.gated_delta_rule)(*pool_args_of(batch))
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)


def test_row_write_kernel_matches_reference():
    """`rows.write_rows` (DMA, in place) against `reference.write_rows`: kept rows out
    of order written, a row not kept left alone, every other row unchanged."""
    rng = np.random.default_rng(11)
    pool = rng.standard_normal((9, 384)).astype(np.float32)
    states = rng.standard_normal((5, 384)).astype(np.float32)
    at, keep = np.array([6, 2, 0, 4, 7], np.int32), np.array([1, 1, 1, 0, 1], bool)
    want = reference.write_rows(jnp.asarray(pool), at, keep, states)
    got = rows.write_rows(jnp.asarray(pool), at, keep, states, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got)[[1, 3, 4, 5, 8]], pool[[1, 3, 4, 5, 8]])


def test_row_write_lowers_for_tpu():
    """At Qwen3.5's windows at TP 4 for 256 requests (``[384, 2048 * 3]``)."""
    pool = jax.ShapeDtypeStruct((384, 6144), jnp.float32)
    index, keep = jax.ShapeDtypeStruct((256,), jnp.int32), jax.ShapeDtypeStruct((256,), bool)
    states = jax.ShapeDtypeStruct((256, 6144), jnp.float32)
    assert lowers_for(rows.write_rows, "tpu", pool, index, keep, states)
