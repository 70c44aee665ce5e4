"""LoRA pieces on their own: the slot matmul against its reference, reading PEFT
folders (fused modules, rank and alpha patterns, refusals, vLLM's not-found error),
the host store's slots, LRU and pins, and the scheduler's cap on adapters per batch
and its pins (a request whose adapter is gone fails alone)."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxengine.core.sched_output import RunnerOutput
from jaxengine.core.scheduler import Scheduler
from jaxengine.lora import LoRAAdapterError, LoRAAdapterNotFoundError, LoRARequest
from jaxengine.lora.peft import read_adapter
from jaxengine.lora.store import AdapterStore
from jaxengine.models.layers.lora import lora_delta, lora_delta_reference
from tests.unit.test_scheduler import make_limits, make_req

LAYER = "model.layers.0"
TARGETS = {
    f"{LAYER}.self_attn.q_proj": (8, 6),
    f"{LAYER}.self_attn.k_proj": (4, 6),
    f"{LAYER}.self_attn.v_proj": (4, 6),
    f"{LAYER}.mlp.down_proj": (6, 10),
}


def test_lora_delta_matches_the_gather_reference():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((13, 6)).astype(np.float32)
    a = rng.standard_normal((6, 4 * 3)).astype(np.float32)  # 4 slots of rank 3
    b = rng.standard_normal((4 * 3, 5)).astype(np.float32)
    slots = rng.integers(0, 5, 13).astype(np.int32)  # 0: the base model, 1..4: a slot
    got = jax.jit(lora_delta, static_argnums=4)(x, slots, a, b, 4)
    want = lora_delta_reference(x, slots, a, b, 4)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(got)[slots == 0])
    np.testing.assert_allclose(got[slots == 2], (x @ a[:, 3:6] @ b[3:6])[slots == 2], rtol=1e-5)
    half = lora_delta(jnp.asarray(x, jnp.bfloat16), slots, a.astype(jnp.bfloat16), b, 4)
    assert half.dtype == jnp.float32


def _write(folder, tensors, **config):
    folder.mkdir(parents=True, exist_ok=True)
    base = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps({**base, **config}))
    named = {f"base_model.model.{k}": v.astype(np.float32) for k, v in tensors.items()}
    save_file(named, str(folder / "adapter_model.safetensors"))
    return folder


def _ab(rng, module, r, out, inp):
    return {
        f"{module}.lora_A.weight": rng.standard_normal((r, inp)),
        f"{module}.lora_B.weight": rng.standard_normal((out, r)),
    }


def test_read_adapter_scales_pads_and_splits_fused_modules(tmp_path):
    rng = np.random.default_rng(1)
    tensors = _ab(rng, f"{LAYER}.self_attn.qkv_proj", 2, 16, 6)
    tensors |= _ab(rng, f"{LAYER}.mlp.down_proj", 3, 6, 10)
    folder = _write(tmp_path / "a", tensors, rank_pattern={"down_proj": 3},
                    alpha_pattern={"down_proj": 9})  # fmt: skip
    weights = read_adapter(folder, TARGETS, max_rank=4)
    fused_b = tensors[f"{LAYER}.self_attn.qkv_proj.lora_B.weight"] * 4 / 2
    for name, rows in (
        ("q_proj", slice(0, 8)),
        ("k_proj", slice(8, 12)),
        ("v_proj", slice(12, 16)),
    ):
        a, b = weights[f"{LAYER}.self_attn.{name}"]
        assert a.shape == (4, 6) and b.shape[1] == 4 and not a[2:].any() and not b[:, 2:].any()
        np.testing.assert_allclose(b[:, :2], fused_b[rows], rtol=1e-6)
    _, down_b = weights[f"{LAYER}.mlp.down_proj"]
    want = tensors[f"{LAYER}.mlp.down_proj.lora_B.weight"] * 9 / 3
    np.testing.assert_allclose(down_b[:, :3], want, rtol=1e-6)
    rs = read_adapter(_write(tmp_path / "rs", tensors, use_rslora=True), TARGETS, max_rank=4)
    np.testing.assert_allclose(
        rs[f"{LAYER}.self_attn.q_proj"][1][:, :2], fused_b[:8] * np.sqrt(2), rtol=1e-6
    )


@pytest.mark.parametrize(
    "config, tensors, message",
    [
        # vLLM's PEFTHelper checks, in its words (its tests' ERROR_CASES)
        (dict(use_dora=True), None, "does not yet support DoRA"),
        (dict(bias="all"), None, "Adapter bias is not supported"),
        (dict(modules_to_save=["lm_head"]), None, "Unsupported modules_to_save: \\['lm_head'\\]"),
        (dict(modules_to_save=["lm_head"]), None, "only supports modules_to_save being None"),
        (dict(lora_bias=True), None, "does not support LoRA bias"),
        (dict(r=0), None, "LoRA rank `r` must be a positive integer, got 0"),
        (dict(r=-8), None, "must be a positive integer"),
        (dict(alora_invocation_tokens=[1, 2]), None, "Activated LoRA"),
        (dict(layer_replication=[[0, 2]]), None, "layer_replication"),
        (dict(use_bdlora={"nblocks": 2}), None, "BD-LoRA"),
        (dict(use_qalora=True), None, "QALoRA"),
        (dict(init_lora_weights="future_init"), None, "init_lora_weights='future_init'"),
        ({}, "only_a", "has lora_A only"),
        ({}, "wrong_rows", "lora_B has 15 rows"),
        ({}, "embed", "'model.embed_tokens' cannot carry an adapter"),
        # the config's ranks count, not only the tensors' (rank 2 here): vLLM's check
        (dict(r=8), None, "LoRA rank 8 is greater than max_lora_rank 4"),
        (dict(rank_pattern={"q_proj": 6}), None, "LoRA rank 6 is greater than max_lora_rank 4"),
        # inits that rewrite the base model's weights when the adapter is made
        (dict(init_lora_weights="pissa"), None, "init_lora_weights='pissa'"),
        (dict(init_lora_weights="pissa_niter_4"), None, "init_lora_weights='pissa_niter_4'"),
        (dict(init_lora_weights="olora"), None, "init_lora_weights='olora'"),
        (dict(init_lora_weights="corda"), None, "init_lora_weights='corda'"),
        (dict(init_lora_weights="loftq"), None, "init_lora_weights='loftq'"),
        # every problem in one message, as vLLM joins them
        (dict(use_dora=True, r=8), None, "support DoRA. LoRA rank 8 is greater than"),
    ],
)
def test_read_adapter_refusals(tmp_path, config, tensors, message):
    rng = np.random.default_rng(2)
    good = _ab(rng, f"{LAYER}.self_attn.q_proj", 2, 8, 6)
    cases = {
        None: good,
        "only_a": {k: v for k, v in good.items() if "lora_A" in k},
        "wrong_rows": _ab(rng, f"{LAYER}.self_attn.qkv_proj", 2, 15, 6),
        "embed": _ab(rng, "model.embed_tokens", 2, 6, 6),
    }
    folder = _write(tmp_path / "bad", cases[tensors], **config)
    with pytest.raises(LoRAAdapterError, match=message):
        read_adapter(folder, TARGETS, max_rank=4)


@pytest.mark.parametrize("init", [True, False, "gaussian", "eva", "orthogonal", "lora_ga"])
def test_inits_that_leave_the_base_alone_are_served(tmp_path, init):
    rng = np.random.default_rng(4)
    folder = _write(tmp_path / "a", _ab(rng, f"{LAYER}.self_attn.q_proj", 2, 8, 6),
                    init_lora_weights=init)  # fmt: skip
    assert set(read_adapter(folder, TARGETS, max_rank=4)) == {f"{LAYER}.self_attn.q_proj"}


@pytest.mark.parametrize("text", ["this is not json", "[1, 2]"])
def test_an_unreadable_config_is_a_bad_adapter(tmp_path, text):
    """vLLM's test_dynamic_lora_invalid_files: a config that is not JSON (or not an
    object) is the adapter's fault (the server's 400), not a missing adapter (404)."""
    folder = _write(
        tmp_path / "bad", _ab(np.random.default_rng(5), f"{LAYER}.mlp.down_proj", 2, 6, 10)
    )
    (folder / "adapter_config.json").write_text(text)
    with pytest.raises(LoRAAdapterError, match="adapter_config.json: ") as info:
        read_adapter(folder, TARGETS, max_rank=4)
    assert not isinstance(info.value, LoRAAdapterNotFoundError)


def test_a_path_without_an_adapter_is_not_found_in_vllms_words(tmp_path):
    """No folder, or a folder without adapter_config.json: vLLM's NotFoundError (its
    server answers 404); a folder with a config but no weights stays a bad adapter."""
    store = AdapterStore(TARGETS, max_rank=2, max_loras=1, max_cpu_loras=1)
    (tmp_path / "empty").mkdir()
    for name in ("nowhere", "empty"):
        lora = LoRARequest(name, 1, str(tmp_path / name))
        with pytest.raises(LoRAAdapterNotFoundError) as info:
            store.add(lora)
        want = f"Loading lora {name} failed: No adapter found for {tmp_path / name}"
        assert str(info.value) == want
    folder = _write(tmp_path / "no_weights", {})
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(LoRAAdapterError, match="no adapter_model.safetensors") as info:
        store.add(LoRARequest("w", 2, str(folder)))
    assert not isinstance(info.value, LoRAAdapterNotFoundError)


def test_store_keeps_resident_slots_and_evicts_the_least_recent(tmp_path):
    rng = np.random.default_rng(3)
    loras = [
        LoRARequest(
            f"l{i}",
            i,
            str(_write(tmp_path / f"l{i}", _ab(rng, f"{LAYER}.self_attn.q_proj", 2, 8, 6))),
        )  # fmt: skip
        for i in (1, 2, 3)
    ]
    store = AdapterStore(TARGETS, max_rank=2, max_loras=2, max_cpu_loras=2)
    l1, l2, l3 = loras
    slots, writes = store.assign([None, l1, l2, l1])
    assert slots == [0, 1, 2, 1] and [s for s, _ in writes] == [1, 2]
    slots, writes = store.assign([l2])
    assert slots == [2] and writes == []  # resident: nothing to write
    slots, writes = store.assign([l3, l2])  # l1 is the least recently used slot
    assert slots == [1, 2] and [s for s, _ in writes] == [1]
    with pytest.raises(RuntimeError, match="mixes 3 LoRA adapters"):
        store.assign([l1, l2, l3])
    assert len(store._host) == 2  # --max-cpu-loras: l1 was dropped, read again on use
    store.assign([l3])
    slots, writes = store.assign([l1])  # l2's slot is now the least recently used
    assert slots == [2] and [s for s, _ in writes] == [2]


def test_scheduler_admits_at_most_max_loras_adapters():
    sched = Scheduler(make_limits(max_loras=2))
    loras = [LoRARequest(f"l{i}", i, "/x") for i in (1, 2, 3)]
    for i, lora in enumerate([loras[0], loras[1], loras[2], None, loras[0]]):
        sched.add_request(make_req(f"r{i}", 4, lora_request=lora))
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"r0", "r1", "r3", "r4"}  # r2 waits
    assert {r.lora_request for r in out.scheduled_new_reqs} == {loras[0], loras[1], None}
    stats = sched.get_stats()
    assert stats.running_lora_adapters == {"l1": 2, "l2": 1}
    assert stats.waiting_lora_adapters == {"l3": 1} and stats.max_lora == 2


def _loras(tmp_path, ids):
    rng = np.random.default_rng(5)
    return [
        LoRARequest(f"l{i}", i, str(_write(tmp_path / f"l{i}",
                                           _ab(rng, f"{LAYER}.self_attn.q_proj", 2, 8, 6))))
        for i in ids
    ]  # fmt: skip


def test_pinned_adapters_stay_on_the_host(tmp_path):
    """A pinned adapter outlives the LRU, its folder and `remove`: the step that
    writes it into a slot reads nothing from disk. The last unpin drops it."""
    l1, l2 = _loras(tmp_path, (1, 2))
    store = AdapterStore(TARGETS, max_rank=2, max_loras=1, max_cpu_loras=1)
    store.add(l1)
    store.pin(l1)
    store.add(l2)  # one adapter fits the host: l2 is dropped, not the pinned l1
    assert list(store._host) == [1]
    shutil.rmtree(l1.lora_path)
    assert store.remove(1) is True
    slots, writes = store.assign([l1])
    assert slots == [1] and [s for s, _ in writes] == [1]
    store.unpin(1)
    assert not store._host and not store._pins
    with pytest.raises(LoRAAdapterNotFoundError, match="Loading lora l1 failed"):
        store.pin(l1)
    assert not store._pins


class FakePins:
    """`AdapterPins` whose adapters in ``gone`` cannot be read."""

    def __init__(self, gone: set[int]) -> None:
        self.gone, self.pins = gone, {}

    def pin_lora(self, lora) -> None:
        if lora.lora_int_id in self.gone:
            raise LoRAAdapterNotFoundError(f"No adapter found for {lora.lora_path}")
        self.pins[lora.lora_int_id] = self.pins.get(lora.lora_int_id, 0) + 1

    def unpin_lora(self, lora_id: int) -> None:
        self.pins[lora_id] -= 1


def test_scheduler_fails_alone_a_request_whose_adapter_is_gone():
    """The adapter is pinned at admission; one that cannot be read finishes only
    its request (aborted with the error, at the next update); the others run, and
    every pin is given back when its request finishes."""
    pins = FakePins(gone={2})
    sched = Scheduler(make_limits(max_loras=2), adapters=pins)
    loras = [LoRARequest(f"l{i}", i, f"/x/l{i}") for i in (1, 2)]
    for rid, lora in (("base", None), ("gone", loras[1]), ("ok", loras[0])):
        sched.add_request(make_req(rid, 4, max_tokens=2, lora_request=lora))
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"base", "ok"} and pins.pins == {1: 1}
    outputs = []
    while sched.has_unfinished_requests():
        ids = list(out.num_scheduled_tokens)
        outputs += sched.update(out, RunnerOutput(ids, [[7] for _ in ids]))
        out = sched.schedule()
    (failed,) = [o for o in outputs if o.request_id == "gone"]
    assert failed.finish_reason == "abort" and failed.stop_reason == "No adapter found for /x/l2"
    done = {o.request_id: o.finish_reason for o in outputs if o.finish_reason}
    assert done == {"gone": "abort", "base": "length", "ok": "length"}
    assert pins.pins == {1: 0}
