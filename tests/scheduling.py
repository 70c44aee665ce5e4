"""How the suite is split between two pytest-xdist workers (`-n 2 --dist loadgroup`).

Each test gets an ``xdist_group``: the tests of one group run on one worker, in order,
so a fixture shared by the group is built once. The groups:

- the tests of one module, by default (module fixtures are built once);
- the tests against one shared server process (``server-dp1``, ``server-dp2``,
  ``vllm_extras_server``, ``smollm2_server``, ``agents_server``), whichever module
  they are in: a second worker would start its own;
- the tests of each session engine of `tests/engine/conftest.py` (``small_llm``,
  ``tiny_llm``), whichever module they are in: the other worker would build its own
  (SmolLM2's is about 20 s);
- one group per test in `SPLIT_MODULES`: modules whose tests each build their own
  engine (tens of seconds each) and share only cheap fixtures, so both workers can
  take them.

Groups run heaviest first (`GROUP_SECONDS`, measured with `--durations=0`), so the
long ones do not start last and leave one worker idle at the end. Without xdist the
groups change nothing but the order, which no test depends on.
"""

from __future__ import annotations

import pytest

SERVER_FIXTURES = ("server", "vllm_extras_server", "smollm2_server", "agents_server")
ENGINE_FIXTURES = ("small_llm", "tiny_llm")
SPLIT_MODULES = (
    "tests/engine/test_engine_golden.py",
    "tests/kernels/test_pallas_attention.py",
    "tests/models/test_new_families_engine.py",
    "tests/server/test_graceful_drain.py",
    "tests/sharding/test_tpu_compile.py",
)
GROUP_SECONDS = {
    # seconds of test time per group in `bash .ci/run` of a34358c (2-core AVX-512 Xeon,
    # cold compilation cache, -n 2, 2026-11-28): every group of 10 s or more
    "small_llm": 221,
    "smollm2_server": 106,
    "tiny_llm": 87,
    "server-dp1": 70,
    "server-dp2": 67,
    "tests/sharding/test_parallel_engine.py": 65,
    "tests/engine/test_spec_decode.py": 62,
    "tests/sharding/test_multihost.py": 61,
    "tests/models/test_golden_real.py": 49,
    "tests/unit/test_bench_device.py": 60,  # + trace, peer and sweep (2026-11-29)
    "tests/models/test_golden_tiny.py": 38,
    "tests/models/test_quantization.py": 37,
    "tests/kernels/test_gated_delta.py": 80,  # measured alone, 2026-11-29
    "tests/kernels/test_gated_delta_pool.py": 14,  # the full suite of 65f9054, 2026-11-29
    "tests/models/test_vision_gemma4.py": 24,  # + the interpreted GPU kernel's case
    "tests/models/test_vision_qwen3_5.py": 18,  # the same run
    "tests/sharding/test_tpu_cache_rows.py": 18,  # the same run
    "tests/sharding/test_tpu_check_vision.py": 34,  # measured alone, 2026-11-29
    "tests/engine/test_mtp.py": 35,  # measured alone, 2026-11-29
    "tests/models/test_gemma4.py": 65,  # -n 2 beside other work, 2026-11-29
    "tests/models/test_qwen3_next.py": 60,  # + DP and rollout tests, beside other work
    "tests/kernels/test_attention_both_ways.py": 32,  # beside other work, 2026-11-29
    "tests/kernels/test_gpu_attention_blocks.py": 12,  # beside other work, 2026-11-29
    "tests/models/test_block_fp8.py": 25,  # beside other work, 2026-11-29
    "tests/kernels/test_quantized_gmm.py": 45,  # beside two TPU compiles, 2026-11-29
    "tests/models/test_qwen3_next_kernels.py": 18,  # beside other work, 2026-11-29
    "tests/kernels/test_cpu_attention.py": 32,
    "tests/torch_fallback/test_golden.py": 31,
    "agents_server": 28,
    "vllm_extras_server": 27,
    "tests/models/test_quantized_checkpoints.py": 25,
    "tests/server/test_vision_server.py": 24,
    "tests/torch_fallback/test_server.py": 23,
    "tests/server/test_quantized_async.py": 23,
    "tests/engine/test_vision_engine.py": 22,
    "tests/models/test_bert.py": 22,
    "tests/engine/test_pooling.py": 22,
    "tests/server/test_lora.py": 20,
    "tests/server/test_harmony_server.py": 20,  # measured alone, 2026-11-29
    "tests/integrations/test_tunix.py": 20,
    "tests/server/test_dp_multinode.py": 18,
    "tests/models/test_fused_projections.py": 18,
    "tests/lora/test_tiny.py": 18,
    "tests/unit/test_loader_gguf_real.py": 17,
    "tests/server/test_scoring_server.py": 17,
    "tests/server/test_embeddings.py": 17,
    "tests/lora/test_smollm2.py": 17,
    "tests/kernels/test_encoder_attention.py": 16,
    "tests/unit/test_no_torch.py": 16,
    "tests/sharding/test_engine_lifetime.py": 16,
    "tests/unit/test_gguf_config.py": 16,
    "tests/engine/test_vision_qwen2_5_vl.py": 15,
    "tests/unit/test_bench_parallel.py": 15,
    "tests/unit/test_bench_vision.py": 15,
    "tests/server/test_vllm_routes.py": 14,
    "tests/cli/test_run_batch.py": 14,
    "tests/kernels/test_reference_attention.py": 13,
    "tests/engine/test_sampler.py": 13,
    "tests/engine/test_startup.py": 11,
    "tests/engine/test_rollout.py": 11,
    "tests/engine/test_vision_gemma3.py": 11,
    "tests/unit/test_bench_structured.py": 11,
    # the TPU compiles of the Llama-3-8B-shaped engine (2 layers): one group each,
    # measured alone on the Xeon (95-137 s with other work beside them; 2026-11-28)
    **{
        f"tests/sharding/test_tpu_compile.py::"
        f"test_engine_compiles_fits_and_moves_no_more_than_it_must[{t}]": 90
        for t in ("v6e-1-1", "v5e-4-4", "v6e-8-8")
    },
}
SPLIT_TEST_SECONDS = 15
"""What one test of a `SPLIT_MODULES` module is counted as (the same run: the golden
conditions 3-37 s, 13 s on average; the Pallas kernel checks 0-12 s)."""


def group_of(item: pytest.Item) -> str:
    """The xdist group of a collected test."""
    fixtures = getattr(item, "fixturenames", ())
    params = item.callspec.params if hasattr(item, "callspec") else {}
    if "server" in params:  # tests/server/conftest.py's shared server, by replica count
        return f"server-dp{params['server']}"
    for name in (*SERVER_FIXTURES[1:], *ENGINE_FIXTURES):
        if name in fixtures:
            return name
    module = item.nodeid.split("::", 1)[0]
    return item.nodeid if module in SPLIT_MODULES else module


def assign_groups(items: list[pytest.Item]) -> None:
    """Marks every test with its `group_of` (xdist turns it into the unit of work).

    On an xdist worker with ``--dist loadgroup`` the group is also appended to the
    node id (``path::test@group``), which is what the scheduler reads: xdist 3.8 does
    that by setting ``item._nodeid``, which pytest 9 no longer reads (a node id is
    ``item._id``), so without this every group was split over both workers and each
    worker started every server of the suite. A group name must not end in "]":
    xdist reads ``...]@name]`` as a parameter holding "@", not as a group."""
    loadgroup = bool(items) and getattr(items[0].config.option, "loadgroup", False)
    for item in items:
        group = group_of(item)
        item.add_marker(pytest.mark.xdist_group(group))
        if loadgroup and "@" not in item.nodeid and hasattr(item, "_id"):
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(f"{item.nodeid}@{group}")


def _weight(group: str) -> float:
    if group in GROUP_SECONDS:
        return GROUP_SECONDS[group]
    return SPLIT_TEST_SECONDS if group.split("::", 1)[0] in SPLIT_MODULES else 0.0


def heaviest_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """``items`` with the groups ordered by weight, heaviest first; the tests inside a
    group, and groups of equal weight, keep their order."""
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(group_of(item), len(first_seen))
    return sorted(items, key=lambda i: (-_weight(group_of(i)), first_seen[group_of(i)]))
