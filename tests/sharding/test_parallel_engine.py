"""Every parallel layout gives the one-device engine's outputs, with the expected
share of the parameters and the KV cache on each device.

For each layout: greedy outputs through `LLM.generate` identical to one device,
last-token logits of a prefill within 1e-4 relative error (float32), and per-device
byte counts, read from the arrays' shards, equal to what the layout should put there.
"""

from __future__ import annotations

import dataclasses

import jax
import pytest
from jax.sharding import PartitionSpec as P

from jaxengine.loader import FUSE_ENV
from sharding.mesh import stage_layers
from tests.models.test_quantized_checkpoints import quantized_copy
from tests.sharding.conftest import PROMPTS
from tests.sharding.engine_checks import (
    build,
    bytes_per_device,
    greedy,
    prefill_logits,
    relative_error,
    runner_of,
    total_bytes,
)

TOLERANCE = 1e-4
SPLIT = {"q_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head"}
KV_PROJ = {"k_proj", "v_proj"}


@dataclasses.dataclass(frozen=True)
class Reference:
    outputs: list
    logits: object
    params: dict  # path -> nbytes of the one-device parameters
    kv_bytes_per_layer: int
    num_kv_heads: int
    num_layers: int


def _param_bytes(params) -> dict[tuple, int]:
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {tuple(k.key for k in path): leaf.nbytes for path, leaf in flat}


def _reference(model: str) -> Reference:
    # Unfused, so its parameters name q/k/v and gate/up apart as tensor-parallel
    # layouts store them (one device fuses them: `jaxengine.loader.fuse_projections`).
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(FUSE_ENV, "0")
        llm = build(model)
    try:
        runner = runner_of(llm)
        logits = prefill_logits(llm)
        outputs = greedy(llm)
        caches = runner.kv_caches
        return Reference(
            outputs,
            logits,
            _param_bytes(runner.params),
            caches[0].nbytes,
            llm.engine.model_config.num_kv_heads,
            len(caches),
        )
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def llama_reference(llama_dir) -> Reference:
    return _reference(llama_dir)


def _layer_of(path: tuple) -> int | None:
    for key in path:
        if key.startswith("layers_"):
            return int(key.split("_")[1])
    return None


def expected_param_bytes(ref: Reference, tp: int, pp: int, stage: int) -> int:
    """What one device of pipeline stage ``stage`` should hold under tp x pp."""
    layers = stage_layers(ref.num_layers, pp)[stage]
    total = 0
    for path, nbytes in ref.params.items():
        layer = _layer_of(path)
        if layer is not None and layer not in layers:
            continue
        if layer is None and "embed_tokens" in path and stage != 0:
            continue
        if layer is None and "embed_tokens" not in path and stage != pp - 1:
            continue
        split = bool(SPLIT & set(path)) or (KV_PROJ & set(path) and ref.num_kv_heads % tp == 0)
        total += nbytes // tp if split else nbytes
    return total


def expected_kv_bytes(ref: Reference, tp: int, pp: int, stage: int) -> int:
    """KV heads split over tp, or one KV head per device when there are fewer heads."""
    per_layer = ref.kv_bytes_per_layer // min(tp, ref.num_kv_heads)
    return per_layer * len(stage_layers(ref.num_layers, pp)[stage])


LAYOUTS = [
    pytest.param(dict(tensor_parallel_size=2), id="tp2"),
    pytest.param(dict(tensor_parallel_size=4), id="tp4"),
    pytest.param(dict(tensor_parallel_size=8), id="tp8"),
    pytest.param(dict(pipeline_parallel_size=2), id="pp2"),
    pytest.param(dict(pipeline_parallel_size=4), id="pp4"),
    pytest.param(dict(tensor_parallel_size=2, pipeline_parallel_size=2), id="tp2xpp2"),
    # the Pallas kernels (GPU kernels, interpreted on CPU) per shard under shard_map,
    # with one KV head per device
    pytest.param(dict(tensor_parallel_size=4, attention_backend="pallas"), id="tp4-pallas"),
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_one_device(llama_dir, llama_reference, layout):
    tp = layout.get("tensor_parallel_size", 1)
    pp = layout.get("pipeline_parallel_size", 1)
    llm = build(llama_dir, **layout)
    try:
        runner = runner_of(llm)
        logits = prefill_logits(llm)
        assert relative_error(logits, llama_reference.logits) < TOLERANCE
        assert greedy(llm) == llama_reference.outputs

        params = runner.params if pp > 1 else [runner.params]
        caches = runner.kv_caches if pp > 1 else [runner.kv_caches]
        devices = (
            runner.program.placement.stage_device_groups
            if pp > 1
            else [runner.program.plan.devices]
        )
        assert len({d for group in devices for d in group}) == tp * pp
        for stage, group in enumerate(devices):
            held = bytes_per_device(params[stage])
            kv = bytes_per_device(caches[stage])
            for device in group:
                assert held[device] == expected_param_bytes(llama_reference, tp, pp, stage)
                assert kv[device] == expected_kv_bytes(llama_reference, tp, pp, stage)
    finally:
        llm.shutdown()


def test_tensor_parallel_specs(llama_dir):
    """Column-parallel q/gate, row-parallel o/down, vocabulary split, KV heads split."""
    llm = build(llama_dir, tensor_parallel_size=2)
    try:
        runner = runner_of(llm)
        layer = runner.params["model"]["layers_0"]
        assert layer["self_attn"]["q_proj"]["weight"].sharding.spec == P("tensor", None)
        assert layer["self_attn"]["k_proj"]["weight"].sharding.spec == P("tensor", None)
        assert layer["self_attn"]["o_proj"]["weight"].sharding.spec == P(None, "tensor")
        assert layer["mlp"]["down_proj"]["weight"].sharding.spec == P(None, "tensor")
        assert runner.params["lm_head"]["weight"].sharding.spec == P("tensor", None)
        assert layer["input_layernorm"]["weight"].sharding.is_fully_replicated
        cache_spec = list(runner.kv_caches[0].sharding.spec)
        while cache_spec and cache_spec[-1] is None:  # trailing Nones say nothing
            cache_spec.pop()
        assert cache_spec == [None, None, "tensor"]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def moe_reference(moe_dir) -> Reference:
    return _reference(moe_dir)


@pytest.mark.parametrize(
    "expert_parallel, spec",
    [(True, P("tensor", None, None)), (False, P(None, None, "tensor"))],  # [E, H, I]
    ids=["ep4", "tp4-experts-split-by-columns"],
)
def test_moe_expert_parallel(moe_dir, moe_reference, expert_parallel, spec):
    llm = build(moe_dir, tensor_parallel_size=4, enable_expert_parallel=expert_parallel)
    try:
        runner = runner_of(llm)
        assert relative_error(prefill_logits(llm), moe_reference.logits) < TOLERANCE
        assert greedy(llm) == moe_reference.outputs
        experts = runner.params["model"]["layers_0"]["mlp"]["experts_gate_proj"]
        assert experts.sharding.spec == spec
        held = bytes_per_device(experts)
        assert set(held.values()) == {experts.nbytes // 4}
        if expert_parallel:  # each device holds 2 of the 8 experts whole
            assert {s.data.shape[0] for s in experts.addressable_shards} == {2}
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "model, parallel, weight",
    [
        ("llama", dict(tensor_parallel_size=2), ("self_attn", "q_proj", "weight")),
        (
            "moe",
            dict(tensor_parallel_size=4, enable_expert_parallel=True),
            ("mlp", "experts_gate_proj"),
        ),
        ("gptq", dict(tensor_parallel_size=2), ("self_attn", "o_proj", "weight")),
    ],
    ids=["int8-tp2", "int8-ep4", "gptq-act-order-tp2"],
)
def test_quantized_weights_and_scales_split_like_float_ones(
    llama_dir, moe_dir, tmp_path, model, parallel, weight
):
    """Quantized parameters shard as the float ones do (the scales by their rows or
    experts; a packed int4 row-parallel weight and its groups by their columns), with
    the quantized one-device engine's outputs."""
    if model == "gptq":
        path, flags = quantized_copy(llama_dir, tmp_path / "gptq", "gptq-act-order"), {}
    else:
        path, flags = {"llama": llama_dir, "moe": moe_dir}[model], dict(quantization="int8")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(FUSE_ENV, "0")
        one = build(path, **flags)
    try:
        want_logits, want = prefill_logits(one), greedy(one)
    finally:
        one.shutdown()
    llm = build(path, **flags, **parallel)
    try:
        assert relative_error(prefill_logits(llm), want_logits) < TOLERANCE
        assert greedy(llm) == want
        layer = runner_of(llm).params["model"]["layers_0"]
        for key in weight[:-1]:
            layer = layer[key]
        q, scale = layer[weight[-1]], layer[weight[-1] + "_scale"]
        assert q.dtype == (jax.numpy.uint8 if model == "gptq" else jax.numpy.int8)
        devices = parallel["tensor_parallel_size"]
        assert set(bytes_per_device(q).values()) == {q.nbytes // devices}
        split = 1 if model == "gptq" else devices  # act-order: every device has every group
        assert set(bytes_per_device(scale).values()) == {scale.nbytes // split}
    finally:
        llm.shutdown()


def test_data_parallel_replicas(llama_dir, llama_reference):
    """Two replicas on disjoint devices, each with the whole model, same outputs."""
    llm = build(llama_dir, data_parallel_size=2)
    try:
        assert greedy(llm) == llama_reference.outputs
        assert relative_error(prefill_logits(llm), llama_reference.logits) < TOLERANCE
        replicas = llm.engine.replicas
        assert len(replicas) == 2
        devices = [set(r.executor.runner.program.plan.devices) for r in replicas]
        assert not devices[0] & devices[1]
        for replica, group in zip(replicas, devices, strict=True):
            held = bytes_per_device(replica.executor.runner.params)
            assert set(held) == group
            assert held[next(iter(group))] == total_bytes(replica.executor.runner.params)
    finally:
        llm.shutdown()


def test_tensor_and_data_parallel(llama_dir, llama_reference):
    """TP 2 x DP 2: two replicas, each split over its own two devices."""
    llm = build(llama_dir, tensor_parallel_size=2, data_parallel_size=2)
    try:
        assert greedy(llm) == llama_reference.outputs
        assert relative_error(prefill_logits(llm), llama_reference.logits) < TOLERANCE
        replicas = llm.engine.replicas
        groups = [set(r.executor.runner.program.plan.devices) for r in replicas]
        assert [len(g) for g in groups] == [2, 2] and not groups[0] & groups[1]
        for replica in replicas:
            held = bytes_per_device(replica.executor.runner.params)
            assert set(held.values()) == {expected_param_bytes(llama_reference, 2, 1, 0)}
    finally:
        llm.shutdown()


def test_sizes_that_do_not_fit_are_refused(llama_dir):
    with pytest.raises(ValueError, match="needs 16 devices, but 8 are available"):
        build(llama_dir, tensor_parallel_size=8, data_parallel_size=2)
    with pytest.raises(ValueError, match="attention heads are not divisible by"):
        build(llama_dir, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="5 stages"):
        build(llama_dir, pipeline_parallel_size=5)


def test_pipeline_micro_batches_overlap_stages(llama_dir, llama_reference, monkeypatch):
    """A step of 4 requests on 2 stages runs as 2 micro-batches, dispatched stage by
    stage before any result is read, with the one-device outputs and prompt logprobs."""
    from jaxengine import SamplingParams
    from jaxengine.runner.pipeline import PipelineStages

    llm = build(llama_dir, pipeline_parallel_size=2)
    try:
        calls = []
        step = PipelineStages.step

        def counting(self, params, kv_caches, batch, fed_ids):
            calls.append(int(batch.num_seqs))
            return step(self, params, kv_caches, batch, fed_ids)

        monkeypatch.setattr(PipelineStages, "step", counting)
        assert greedy(llm) == llama_reference.outputs
        assert max(calls) < 4  # never the whole 4-request step in one batch
        params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2, logprobs=2)
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        out = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.prompt_logprobs) == len(p) for o, p in zip(out, PROMPTS, strict=True))
        assert all(len(o.outputs[0].logprobs) == 2 for o in out)
    finally:
        llm.shutdown()


def test_split_balanced():
    from jaxengine.runner.pipeline import split_balanced

    assert split_balanced([5, 5, 5, 5], 2) == [[0, 1], [2, 3]]
    assert split_balanced([30, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert split_balanced([1, 1, 1, 30], 2) == [[0, 1, 2], [3]]
    assert split_balanced([3], 4) == [[0]]
    assert split_balanced([4, 4], 4) == [[0], [1]]
