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
)
GROUP_SECONDS = {
    # seconds on a 2-core AVX-512 Xeon, cold compilation cache, one process (2026-11-26);
    # the tiny-model server groups, smollm2_server and test_lora.py re-estimated after
    # the move to the tiny model: measured with -n 2 beside other load, scaled by
    # test_structured_outputs.py's ratio (165 s here, 360 s there); start-up, data
    # parallel, golden_real and loader_gguf_real re-estimated after their moves to
    # the tiny model and to the run's shared transformers references
    "smollm2_server": 200,  # test_structured_outputs.py's 165 and the beam chat tests
    "server-dp2": 88,
    "server-dp1": 67,
    "tests/sharding/test_parallel_engine.py": 108,
    "tests/engine/test_spec_decode.py": 96,
    "tests/models/test_golden_real.py": 60,
    "tests/engine/test_startup.py": 20,
    "tests/models/test_quantization.py": 84,
    "tests/sharding/test_multihost.py": 68,
    "tests/server/test_quantized_async.py": 64,
    "tests/models/test_golden_tiny.py": 63,
    "tests/kernels/test_cpu_attention.py": 62,
    "tests/torch_fallback/test_golden.py": 62,
    "tests/engine/test_data_parallel.py": 35,
    "tests/lora/test_smollm2.py": 52,
    "tests/unit/test_loader_gguf_real.py": 40,
    "tests/integrations/test_tunix.py": 45,  # a Tunix GRPO step beside a tiny engine
    "tests/unit/test_gguf_config.py": 55,  # measured beside other load (2 cores busy)
    "tests/unit/test_no_torch.py": 45,  # idem; a torch-less SmolLM2 engine compiling
    "vllm_extras_server": 42,
    # the engines' groups (2026-11-28, from the per-module times of a -n 2 run)
    "small_llm": 290,  # structured outputs, quantization, beam search, LLM API, rollout
    "tiny_llm": 180,  # async scheduling, rollout, no-recompile, thinking budget, ...
    "agents_server": 35,  # responses, Anthropic messages, decisions: 45 s with two starts
    "tests/cli/test_run_batch.py": 49,
    "tests/lora/test_tiny.py": 47,
    "tests/engine/test_pooling.py": 39,
    "tests/models/test_fused_projections.py": 38,
    "tests/unit/test_bench_structured.py": 37,
    "tests/models/test_quantized_checkpoints.py": 37,
    "tests/kernels/test_encoder_attention.py": 33,
    "tests/sharding/test_engine_lifetime.py": 31,
    "tests/kernels/test_reference_attention.py": 31,
    "tests/server/test_lora.py": 17,
    # images (2026-11-27, one process beside other load): their own tiny engines/server
    "tests/engine/test_vision_engine.py": 40,
    "tests/server/test_vision_server.py": 35,
    "tests/engine/test_vision_gemma3.py": 25,
    "tests/unit/test_bench_vision.py": 25,
}
SPLIT_TEST_SECONDS = 40
"""What one test of a `SPLIT_MODULES` module is counted as (they take 20-70 s)."""


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
