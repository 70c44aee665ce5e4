"""`layers.routing.route`: each variant against a per-token reference written from
its definition (the golden tests check whole models against transformers)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxengine.models.layers.routing import RoutingSpec, route


def logit(p: np.ndarray) -> np.ndarray:
    return np.log(p) - np.log1p(-p)


def reference_route(logits, spec: RoutingSpec, k, renormalize, bias=None):
    """One token at a time: scores, eligible experts, the k best, their weights."""
    num_experts = logits.shape[1]
    weights, experts = [], []
    for row in logits.astype(np.float64):
        if spec.scoring == "softmax":
            scores = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
        else:
            scores = 1 / (1 + np.exp(-row))
        choice = scores + (0 if bias is None else bias)
        size = num_experts // spec.n_group
        groups = [choice[g * size : (g + 1) * size] for g in range(spec.n_group)]
        ranks = [np.sort(g)[::-1][:2].sum() for g in groups]
        kept = set(np.argsort(ranks)[::-1][: spec.topk_group].tolist())
        eligible = [e for e in range(num_experts) if e // size in kept]
        chosen = sorted(eligible, key=lambda e: -choice[e])[:k]
        w = scores[chosen]
        if renormalize:
            w = w / w.sum()
        weights.append(w * spec.scaling_factor)
        experts.append(chosen)
    return np.array(weights), np.array(experts)


def check(logits, spec, k, renormalize, bias=None):
    got_w, got_e = route(logits, spec, k, renormalize, bias)
    want_w, want_e = reference_route(np.asarray(logits), spec, k, renormalize, bias)
    np.testing.assert_array_equal(np.asarray(got_e), want_e)
    np.testing.assert_allclose(np.asarray(got_w), want_w, rtol=1e-5, atol=1e-7)
    assert got_w.dtype == np.float32 and got_e.dtype == np.int32


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_top_k(renormalize):
    logits = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32)
    check(logits, RoutingSpec(), 2, renormalize)


@pytest.mark.parametrize("n_group, topk_group", [(1, 1), (4, 2), (4, 1), (8, 3)])
def test_sigmoid_group_limited_with_bias(n_group, topk_group):
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(32, 8)).astype(np.float32)
    bias = (0.3 * rng.normal(size=8)).astype(np.float32)
    spec = RoutingSpec("sigmoid", True, n_group, topk_group, scaling_factor=2.5)
    check(logits, spec, 2 if topk_group == 1 else 3, True, bias)


def test_sigmoid_top1_without_renormalizing():
    """Llama 4's routing: the best logit's sigmoid, not renormalized to 1."""
    logits = np.random.default_rng(2).normal(size=(8, 4)).astype(np.float32)
    weights, experts = route(logits, RoutingSpec("sigmoid"), 1, False)
    np.testing.assert_array_equal(np.asarray(experts)[:, 0], logits.argmax(axis=1))
    np.testing.assert_allclose(np.asarray(weights)[:, 0], 1 / (1 + np.exp(-logits.max(axis=1))))


def test_bias_chooses_the_group_but_does_not_weigh():
    """Scores [.9, .3 | .6, .5]: group 0 wins on its top-2 sum (1.2 > 1.1); a bias of
    +.1 on group 1 makes it win (1.3), and its experts weigh by .6 and .5."""
    logits = logit(np.array([[0.9, 0.3, 0.6, 0.5]])).astype(np.float32)
    spec = RoutingSpec("sigmoid", True, n_group=2, topk_group=1, scaling_factor=2.0)
    no_bias = np.zeros(4, np.float32)
    weights, experts = route(logits, spec, 2, True, no_bias)
    assert np.asarray(experts).tolist() == [[0, 1]]
    weights, experts = route(logits, spec, 2, True, np.array([0, 0, 0.1, 0.1], np.float32))
    assert np.asarray(experts).tolist() == [[2, 3]]
    np.testing.assert_allclose(np.asarray(weights), [[2 * 0.6 / 1.1, 2 * 0.5 / 1.1]], rtol=1e-5)


def test_invalid_specs_and_arguments():
    with pytest.raises(ValueError, match="scoring"):
        RoutingSpec("relu")
    with pytest.raises(ValueError, match="sigmoid"):
        RoutingSpec("softmax", correction_bias=True)
    with pytest.raises(ValueError, match="topk_group"):
        RoutingSpec("sigmoid", n_group=2, topk_group=3)
    logits = np.zeros((1, 6), np.float32)
    with pytest.raises(ValueError, match="exactly when"):
        route(logits, RoutingSpec("sigmoid"), 1, False, np.zeros(6, np.float32))
    with pytest.raises(ValueError, match="do not split"):
        route(logits, RoutingSpec("sigmoid", n_group=4, topk_group=1), 1, False)
