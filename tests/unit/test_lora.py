"""LoRA pieces on their own: the slot matmul against its reference, reading PEFT
folders (fused modules, rank and alpha patterns, refusals), the host store's slots
and LRU, and the scheduler's cap on adapters per batch."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxengine.core.scheduler import Scheduler
from jaxengine.lora import LoRAAdapterError, LoRARequest
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
        (dict(use_dora=True), None, "use_dora=True"),
        (dict(bias="all"), None, "bias='all'"),
        ({}, "only_a", "has lora_A only"),
        ({}, "wrong_rows", "lora_B has 15 rows"),
        ({}, "embed", "'model.embed_tokens' cannot carry an adapter"),
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
