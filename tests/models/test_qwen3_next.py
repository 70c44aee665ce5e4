"""Qwen3-Next (MoE + shared expert) and Qwen3.5 (dense): hybrid Gated DeltaNet / gated
attention models through `jaxengine.LLM` against transformers' float32 model.

Each tiny config has both layer kinds. One engine per family serves both checks of
`tests.models.family_engine` (and Qwen3.5-MoE once, under TP 2 with expert
parallelism and prefix caching off): a prompt longer than the token budget (chunked prefill
that stops inside a chunk of the delta rule, at a block's end), few KV pages (a
recompute preemption; the second call reuses state slots, so a fresh request must
start from zeros), prefix-cache hits that resume from a saved state (the second call,
and the fourth prompt sharing the first's 24 tokens), greedy tokens and top-5
logprobs equal to transformers' within 1e-4, and no compilation after warm-up; then
again under tensor parallelism 2 with FULL steps. Qwen3-Next once more on two data-parallel
replicas (six prompts of different lengths; each replica's state slots come back), and
through RL rollouts' calls (weights written, sleep at both levels, a reload). The
last tests are host only: the memory figure (`runner.states.admitted_requests`), state
slots, refusals.
"""

from __future__ import annotations

import numpy as np
import pytest
import transformers

from tests.models.family_engine import (
    ENGINE_KWARGS,
    TOP,
    _generate_and_compare,
    default_prompts,
    reference,
    save_tiny,
)

MAX_TOKENS = 6
_SHAPES = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    max_position_embeddings=128,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)


def qwen3_next_tiny():
    return transformers.Qwen3NextConfig(
        **_SHAPES,
        intermediate_size=96,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        mlp_only_layers=[3],
        architectures=["Qwen3NextForCausalLM"],
    )


def qwen3_5_moe_tiny():
    return transformers.Qwen3_5MoeTextConfig(
        **_SHAPES,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        architectures=["Qwen3_5MoeForCausalLM"],
    )


def qwen3_5_tiny():
    return transformers.Qwen3_5TextConfig(
        **_SHAPES, intermediate_size=96, architectures=["Qwen3_5ForCausalLM"]
    )


def check_hybrid(path, ref, prompts, **engine_kwargs) -> None:
    """``prompts`` through one engine twice (the second call reversed), chunked and
    preempted, each output equal to ``ref``; no compilation after warm-up."""
    from jaxengine import LLM, SamplingParams

    kwargs = {**ENGINE_KWARGS, "num_gpu_blocks_override": 9, "max_model_len": 48}
    # a budget of 29 tokens: the 37-token prompt's first step ends at the end of its
    # third 8-token block (24, where its state is saved: `core.kv_cache.state_cache`),
    # 8 tokens into the second 16-token chunk of the delta rule (`layers.gated_delta.
    # CHUNK`) and inside the kernels' 64-token chunk; the next step resumes mid-chunk
    kwargs = {**kwargs, "max_num_batched_tokens": 29, **engine_kwargs}
    llm = LLM(str(path), **kwargs)
    try:
        executor = llm.engine.executor
        compiles = executor.compiles_after_warmup
        params = SamplingParams(temperature=0, logprobs=TOP, max_tokens=MAX_TOKENS, ignore_eos=True)
        _generate_and_compare(llm, params, prompts, ref, range(len(prompts)))
        first = llm.engine.get_stats()
        assert first.num_preemptions > 0, "no request was preempted"
        _generate_and_compare(llm, params, prompts, ref, reversed(range(len(prompts))))
        hits = llm.engine.get_stats().prefix_cache_hits - first.prefix_cache_hits
        if kwargs["enable_prefix_caching"]:
            assert hits > 0, "no prefix-cache hit resumed from a saved state"
        else:
            assert hits == 0 and first.prefix_cache_hits == 0
        assert executor.compiles_after_warmup == compiles, "compiled after warm-up"
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def tiny(request, tmp_path_factory):
    config = {"qwen3_next": qwen3_next_tiny, "qwen3_5": qwen3_5_tiny}[request.param]()
    # init 0.1, not family_engine's 0.2: at 0.2 transformers' own float32 chunked and
    # recurrent delta-rule forms differ by 1.1e-4 in a top-5 logprob of Qwen3-Next's
    # prompt 0, step 4 (more than the 1e-4 the check allows), so 0.2 tests float32
    # noise of the reference rather than the engine
    path = save_tiny(config, tmp_path_factory.mktemp(request.param), init_range=0.1)
    prompts = default_prompts(config.vocab_size)
    return request.param, path, prompts, reference(path, prompts, MAX_TOKENS)


def test_engine_matches_transformers(tiny):
    _, path, prompts, ref = tiny
    check_hybrid(path, ref, prompts)


def test_tensor_parallel_2_full_step_swap(tiny):
    """TP 2, with the whole step one program (FULL: the accelerators' default; the
    CPU default, PIECEWISE, runs a program per kind of layer), preempted by swap:
    the pages and the states go to the host and come back (`runner.state_swap`)."""
    _, path, prompts, ref = tiny
    kwargs = dict(tensor_parallel_size=2, cudagraph_mode="FULL", swap_space=1)
    check_hybrid(path, ref, prompts, **kwargs)


def test_qwen3_5_moe_expert_parallel(tmp_path_factory):
    """Qwen3.5-MoE (every layer's MLP routed, with the shared expert) under TP 2 with
    expert parallelism, prefix caching off (no saved-state rows): the same checks
    against transformers."""
    config = qwen3_5_moe_tiny()
    # (0.12: at 0.1 the reference's greedy pick is a near-tie at one step)
    path = save_tiny(config, tmp_path_factory.mktemp("qwen3_5_moe"), init_range=0.12)
    prompts = default_prompts(config.vocab_size)
    ref = reference(path, prompts, MAX_TOKENS)
    kwargs = dict(tensor_parallel_size=2, enable_expert_parallel=True)
    check_hybrid(path, ref, prompts, enable_prefix_caching=False, **kwargs)


@pytest.fixture(scope="module")
def qwen3_next_dp(tmp_path_factory):
    """``(path, prompts, reference)``: Qwen3-Next as in `tiny`, six prompts of lengths
    3 to 40 (the longest over the token budget: chunked)."""
    config = qwen3_next_tiny()
    path = save_tiny(config, tmp_path_factory.mktemp("qwen3_next_dp"), init_range=0.1)
    rng = np.random.RandomState(1)
    prompts = [rng.randint(0, config.vocab_size, n).tolist() for n in (3, 7, 12, 19, 26, 40)]
    return path, prompts, reference(path, prompts, MAX_TOKENS)


def test_data_parallel_2(qwen3_next_dp, monkeypatch):
    """Two replicas, one device each: both take requests, every output is transformers'
    greedy tokens and top-5 logprobs (what one engine gives: `check_hybrid`), and
    each replica's linear-attention state slots all come back once the requests end."""
    from jaxengine import LLM, SamplingParams

    path, prompts, ref = qwen3_next_dp
    llm = LLM(str(path), data_parallel_size=2, **ENGINE_KWARGS)
    try:
        replicas = llm.engine.replicas
        taken = [0] * len(replicas)
        for i, replica in enumerate(replicas):
            add = replica.add_prepared

            def counted(*args, _i=i, _add=add, **kwargs):
                taken[_i] += 1
                return _add(*args, **kwargs)

            monkeypatch.setattr(replica, "add_prepared", counted)
        params = SamplingParams(temperature=0, logprobs=TOP, max_tokens=MAX_TOKENS, ignore_eos=True)
        _generate_and_compare(llm, params, prompts, ref, range(len(prompts)))
        assert min(taken) >= 2 and sum(taken) == len(prompts), taken
        seqs = ENGINE_KWARGS["max_num_seqs"]
        for replica in replicas:
            # the runner learns of a step's finished requests with the next step: one idle
            replica.step()
            table = replica.executor.runner.table
            assert not table.requests and not replica.has_unfinished_requests()
            assert sorted(table._free_slots) == list(range(seqs)), "a state slot was kept"
    finally:
        llm.engine.shutdown()


def test_sleep_and_weight_updates(qwen3_next_dp):
    """RL rollouts on a hybrid model: dummy weights written by `update_weights` (the
    checkpoint's Gated DeltaNet tensors included) give transformers' outputs; so do
    the same requests after sleep level 1 (weights parked on the host, the KV cache
    and the linear-attention states freed) and after level 2 then `reload_weights`."""
    from safetensors.numpy import load_file

    from jaxengine import LLM, SamplingParams

    path, prompts, ref = qwen3_next_dp
    tensors = load_file(f"{path}/model.safetensors")
    assert any(".linear_attn." in name for name in tensors)
    llm = LLM(str(path), load_format="dummy", enable_sleep_mode=True, **ENGINE_KWARGS)
    params = SamplingParams(temperature=0, logprobs=TOP, max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        assert llm.update_weights(tensors) > 0
        _generate_and_compare(llm, params, prompts, ref, range(len(prompts)))
        llm.sleep(level=1)
        llm.wake_up()
        _generate_and_compare(llm, params, prompts, ref, reversed(range(len(prompts))))
        llm.sleep(level=2)
        llm.wake_up()
        assert llm.reload_weights() > 0
        _generate_and_compare(llm, params, prompts, ref, range(len(prompts)))
    finally:
        llm.engine.shutdown()


def test_memory_figure_and_state_sizing():
    """For one budget, Qwen3.5's shape (24 Gated DeltaNet + 8 attention layers) admits
    several times the 32k-token requests of the same model with attention everywhere."""
    import dataclasses

    from jaxengine.models import family_config
    from jaxengine.runner.states import admitted_requests, state_bytes

    hybrid = family_config(transformers.Qwen3_5TextConfig(), "float32")
    dense = dataclasses.replace(
        hybrid,
        layers=tuple(dataclasses.replace(s, linear=False) for s in hybrid.layers),
        family_spec=None,
    )
    budget = 64 << 30
    got = admitted_requests(hybrid, budget, 32768)
    plain = admitted_requests(dense, budget, 32768)
    assert (got.requests, plain.requests) == (61, 16)
    assert got.kv_bytes_per_request * 4 == plain.kv_bytes_per_request
    gdn = hybrid.family_spec.gated_delta  # one request: 24 layers of conv window + state
    per_layer = 4 * (3 * gdn.conv_dim + gdn.num_v_heads * gdn.head_k_dim * gdn.head_v_dim)
    assert got.state_bytes_per_request == 24 * per_layer
    from jaxengine.models.layers.gated_delta import layer_state_shapes

    assert state_bytes(layer_state_shapes(hybrid, 8)) == 8 * 24 * per_layer


def test_state_slots_follow_running_requests():
    """A slot per running request: taken when it is scheduled from no computed tokens,
    given back on preemption (the recompute takes a fresh one) and on finishing."""
    from jaxengine.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
    from jaxengine.runner.request_table import RequestTable
    from jaxengine.sampling_params import SamplingParams

    def step(new=(), cached=(), finished=(), preempted=()):
        return SchedulerOutput(
            scheduled_new_reqs=tuple(
                NewRequestData(r, (1, 2, 3), SamplingParams(), (1,), 0) for r in new
            ),
            scheduled_cached_reqs=tuple(
                CachedRequestData(r, True, (2,), 0, (1, 2, 3)) for r in cached
            ),
            num_scheduled_tokens={},
            total_num_scheduled_tokens=0,
            finished_req_ids=frozenset(finished),
            preempted_req_ids=frozenset(preempted),
        )

    table = RequestTable(4, 0, state_slots=2)
    table.apply(step(new=["a", "b"]))
    assert {table["a"].state_slot, table["b"].state_slot} == {0, 1}
    assert table.chunk(table["a"], 3).state_row == table["a"].state_slot
    table.apply(step(preempted=["a"], new=["c"]))
    assert table["a"].state_slot == -1 and table["c"].state_slot >= 0
    table.apply(step(finished=["b"], cached=["a"]))
    assert table["a"].state_slot >= 0 and table["a"].state_slot != table["c"].state_slot
    plain = RequestTable(4, 0)  # a model without states: no slots, rows -1
    plain.apply(step(new=["d"]))
    assert plain.chunk(plain["d"], 3).state_row == -1


def test_hybrid_limits_refuse_and_disable():
    """Speculative decoding is refused; swap space stays; prefix caching keeps
    half as many saved-state rows again as request slots (at least 4), after them."""
    import dataclasses
    import types

    from jaxengine.runner.states import hybrid_limits

    fields = ["enable_prefix_caching", "num_host_blocks", "state_cache_rows"]
    limits = dataclasses.make_dataclass("Limits", fields)(True, 5, (0, 0))
    config = types.SimpleNamespace(
        speculative_config=types.SimpleNamespace(enabled=False),
        parallel_config=types.SimpleNamespace(pipeline_parallel_size=1),
        scheduler_config=types.SimpleNamespace(max_num_seqs=10),
        cache_config=types.SimpleNamespace(prefix_caching=True),
    )
    states = ((((1, 3, 8), (1, 2, 4, 4))),)
    out = hybrid_limits(config, limits, states)
    assert (out.enable_prefix_caching, out.num_host_blocks) == (True, 5)
    assert out.state_cache_rows == (10, 5)
    assert hybrid_limits(config, limits, None) is limits
    config.speculative_config.enabled = True
    with pytest.raises(ValueError, match="speculative decoding is not supported"):
        hybrid_limits(config, limits, states)
