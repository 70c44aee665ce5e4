"""The gated delta rule's Pallas kernels (interpret mode) inside a tiny Qwen3.5's
forward, against the CPU default (the reference in 16-token chunks), over two ragged
steps: prompts whose first chunk leaves a state, then a step where one prompt
continues from it (nonzero state), one decodes, one starts fresh, beside a padding
request and padding tokens. The backends' functions go in through
``attention_kwargs`` as the engine passes them (`AttentionBackend.module_kwargs`).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.loader.params import abstract_params
from jaxengine.models import get_model
from jaxengine.models.layers.attention import kv_cache_shape
from jaxengine.models.layers.gated_delta import layer_state_shapes
from jaxengine.models.layers.metadata import AttentionMetadata
from jaxengine.runner.attention_backend import kernels, select_attention_backend
from pallas_kernels.gated_delta import gpu, rows, tpu
from tests.models.test_qwen3_next import qwen3_5_tiny

PAGE_SIZE = 4
PAGES_PER_REQ = 12
SLOTS = 4  # state slots; request r holds slot SLOT_OF[r]
SLOT_OF = (2, 0, 3)
TOLERANCE = 1e-4
"""Relative error, float32: the kernels' own chunks and the reference's 16-token ones
sum the same rule in different orders (measured 1.8e-6 for both kernels)."""

STEPS = (
    # (new tokens per request, context before the step per request)
    ((11, 19, 0), (0, 0, 0)),  # two prompts' first chunks (request 2 not yet here)
    ((13, 1, 7), (11, 19, 0)),  # 0 continues (nonzero state), 1 decodes, 2 starts
)


def _metadata(new: tuple, before: tuple, num_tokens: int) -> AttentionMetadata:
    """A step's metadata: requests ``new > 0`` in order, then one padding request;
    request r owns pages ``1 + r * PAGES_PER_REQ ...`` (page 0 is the null page)."""
    real = [r for r, n in enumerate(new) if n]
    qsl = np.zeros(len(new) + 2, np.int32)  # real requests, then padding requests
    qsl[1 : len(real) + 1] = np.cumsum([new[r] for r in real])
    qsl[len(real) + 1 :] = qsl[len(real)]
    slots = np.full(num_tokens, -1, np.int32)  # padding tokens: past the cache's end
    pages = np.zeros((len(new) + 1, PAGES_PER_REQ), np.int32)
    seq_lens, rows = np.zeros(len(new) + 1, np.int32), np.full(len(new) + 1, -1, np.int32)
    for i, r in enumerate(real):
        pages[i] = 1 + r * PAGES_PER_REQ + np.arange(PAGES_PER_REQ)
        pos = before[r] + np.arange(new[r])
        slots[qsl[i] : qsl[i + 1]] = pages[i][pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
        seq_lens[i], rows[i] = before[r] + new[r], SLOT_OF[r]
    slots[slots < 0] = (1 + len(new) * PAGES_PER_REQ) * PAGE_SIZE
    as_jnp = functools.partial(jnp.asarray, dtype=jnp.int32)
    return AttentionMetadata(
        seq_lens=as_jnp(seq_lens),
        query_start_loc=as_jnp(qsl),
        page_table=as_jnp(pages),
        slot_mapping=as_jnp(slots),
        num_seqs=as_jnp(len(real)),
        state_rows=as_jnp(rows),
    )


def _inputs(new: tuple, before: tuple, num_tokens: int, rng) -> tuple:
    real = [r for r, n in enumerate(new) if n]
    positions = np.zeros(num_tokens, np.int32)
    positions[: sum(new)] = np.concatenate([before[r] + np.arange(new[r]) for r in real])
    tokens = rng.integers(0, 256, num_tokens).astype(np.int32)
    return jnp.asarray(tokens), jnp.asarray(positions), _metadata(new, before, num_tokens)


def _random_params(module, config, seed=0):
    """Every parameter normal(0, 0.2): large enough for the rule's state to matter."""
    tree = nn.unbox(abstract_params(module, config))
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    rng = np.random.default_rng(seed)
    values = [jnp.asarray(0.2 * rng.standard_normal(x.shape), x.dtype) for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, values)


def run_steps(attention_kwargs: dict):
    """Both steps' hidden states and the final state pools with ``attention_kwargs``."""
    config_hf = qwen3_5_tiny()
    module, config = get_model(config_hf, "float32", attention_kwargs)
    params = _random_params(module, config)
    page = kv_cache_shape(config, 2 + len(SLOT_OF) * PAGES_PER_REQ, PAGE_SIZE)
    caches = tuple(
        jnp.zeros(page, jnp.float32) if s is None else tuple(jnp.zeros(x) for x in s)
        for s in layer_state_shapes(config, SLOTS)
    )
    forward = jax.jit(functools.partial(module.apply, {"params": params}))
    rng, hidden = np.random.default_rng(1), []
    for new, before in STEPS:
        tokens, positions, md = _inputs(new, before, 40, rng)
        out, caches = forward(tokens, positions, caches, md)
        hidden.append(np.asarray(out[: sum(new)]))
    states = [np.asarray(x) for c in caches if isinstance(c, tuple) for x in c]
    return hidden, states


def _relative(got, want) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.fixture(scope="module")
def reference_run():
    backend = select_attention_backend("reference", "cpu", gated_delta=True)
    return run_steps(backend.module_kwargs())


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_gated_delta_kernels_inside_the_model(platform, reference_run):
    """The model with ``platform``'s kernel (interpreted) equals the reference path:
    every token's hidden state of both steps and every state pool (on TPU the
    convolution windows' rows are written by the DMA kernel too)."""
    attention, update = kernels("reference")
    rule = {"tpu": tpu.gated_delta_rule, "gpu": gpu.gated_delta_rule}[platform]
    kwargs = {
        "attention_fn": attention,
        "update_fn": update,
        "gated_delta_fn": functools.partial(rule, interpret=True),
    }
    if platform == "tpu":
        kwargs["state_write_fn"] = functools.partial(rows.write_rows, interpret=True)
    hidden, states = run_steps(kwargs)
    want_hidden, want_states = reference_run
    assert max(np.abs(s).max() for s in want_states) > 0.1, "the states stayed near zero"
    for step, (got, want) in enumerate(zip(hidden, want_hidden, strict=True)):
        assert np.isfinite(got).all()
        err = _relative(got, want)
        assert err < TOLERANCE, f"{platform}: step {step}: relative error {err:.2e}"
    for got, want in zip(states, want_states, strict=True):
        assert _relative(got, want) < TOLERANCE, f"{platform}: state pools differ"


@pytest.mark.parametrize("num_k_heads", [2, 1], ids=["split", "replicated"])
def test_kernel_per_tensor_shard(num_k_heads):
    """Under tensor parallelism 2 the rule runs per shard of its heads
    (`sharding.attention.shard_gated_delta`; replicated when the key heads do not
    split): the TPU kernel, interpreted, equals the reference on the whole batch."""
    from jax.sharding import Mesh

    from pallas_kernels.gated_delta import reference
    from sharding.attention import shard_gated_delta
    from tests.kernels.test_gated_delta import ragged_batch
    from tests.kernels.test_gated_delta_pool import pool_args_of, pooled

    args = pool_args_of(pooled(ragged_batch((9, 1, 20), hk=num_k_heads, hv=4)))
    mesh = Mesh(np.array(jax.devices()[:2]), ("tensor",))
    rule = shard_gated_delta(functools.partial(tpu.gated_delta_rule, interpret=True), mesh)
    out, state = jax.jit(rule)(*args)
    want_out, want_state = reference.gated_delta_rule(*args)
    assert _relative(np.asarray(out), np.asarray(want_out)) < TOLERANCE
    assert _relative(np.asarray(state), np.asarray(want_state)) < TOLERANCE
