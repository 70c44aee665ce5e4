"""The rollout engine's calls (RL): sleep and wake, weight updates, reload.

Every check compares greedy tokens with an engine loaded from the checkpoint: an
engine started with ``load_format="dummy"`` and given the checkpoint's tensors through
`LLM.update_weights` must answer exactly as the checkpoint does, under tensor
parallelism and quantization too; sleep and wake must not change an answer; a bad
update must change nothing. Most run on the tiny model (SmolLM2's tokenizer, two
random layers); one runs SmolLM2's real weights.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxengine import LLM, SamplingParams
from jaxengine.engine.rollout import EngineSleepingError
from jaxengine.loader import checkpoint_tensors
from jaxengine.loader.errors import CheckpointError
from tests.engine.conftest import small_llm_kwargs
from tests.xla_effort import optimized

PROMPTS = ["Hello there", "The capital of France is", "1, 2, 3,"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def tokens(llm) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def tensors_of(llm) -> dict[str, np.ndarray]:
    """The engine's checkpoint, read again (`loader.checkpoint_tensors`)."""
    config = llm.engine.config
    return dict(checkpoint_tensors(config.model_config, config.load_config))


def device_bytes(arrays) -> int:
    return sum(a.nbytes for a in arrays if not a.is_deleted())


@pytest.fixture(scope="module")
def kwargs(xla_cache_dir):
    return {**small_llm_kwargs(xla_cache_dir), "enable_sleep_mode": True}


@pytest.fixture(scope="module")
def expected(tiny_llm):
    """The tiny checkpoint's greedy tokens (the shared engine, loaded from its files)."""
    return tokens(tiny_llm)


@pytest.fixture(scope="module")
def dummy(tiny_smollm2, kwargs):
    """The tiny model with random weights, in sleep mode."""
    with LLM(str(tiny_smollm2[0]), load_format="dummy", **kwargs) as llm:
        yield llm


def test_dummy_engine_fed_smollm2_weights_answers_as_the_checkpoint(
    small_llm, smollm2_gguf, xla_cache_dir
):
    want = tokens(small_llm)
    kwargs = {**small_llm_kwargs(xla_cache_dir), "enforce_eager": True}
    # SmolLM2's 30 layers, compared token for token with small_llm's (tests/xla_effort.py)
    with optimized(), LLM(str(smollm2_gguf), load_format="dummy", **kwargs) as llm:
        assert tokens(llm) != want
        assert llm.update_weights(tensors_of(small_llm)) > 0
        assert tokens(llm) == want
        assert llm.engine.executor.compiles_after_warmup == 0


def test_sleep_frees_the_device_and_wake_up_answers_the_same(tiny_smollm2, kwargs, expected):
    before = {id(a) for a in jax.live_arrays()}
    with LLM(str(tiny_smollm2[0]), **kwargs) as llm:
        assert tokens(llm) == expected
        awake = device_bytes(a for a in jax.live_arrays() if id(a) not in before)
        llm.sleep(level=1)
        assert llm.is_sleeping()
        # what this engine holds on device now (the weights' host copies are numpy)
        asleep = device_bytes(a for a in jax.live_arrays() if id(a) not in before)
        assert asleep <= 0.1 * awake, (asleep, awake)
        with pytest.raises(EngineSleepingError, match="asleep"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        llm.wake_up()
        assert not llm.is_sleeping()
        assert tokens(llm) == expected
        assert llm.engine.executor.compiles_after_warmup == 0


def test_trl_colocate_sequence_gives_the_checkpoints_answers(dummy, tiny_smollm2, expected):
    """sleep(2), wake_up(weights), update_weights (torch tensors), reset_prefix_cache,
    wake_up(kv_cache): TRL's order with a colocated trainer."""
    assert tokens(dummy) != expected
    dummy.sleep(level=2)
    assert dummy.engine.get_stats().sleep_level == 2  # metrics: discard_all
    dummy.wake_up(["weights"])
    assert dummy.is_sleeping()  # the KV cache still sleeps
    state = tiny_smollm2[1].state_dict()  # the trainer's torch tensors
    assert dummy.update_weights(state.items()) > 0
    assert dummy.reset_prefix_cache()
    dummy.wake_up(["kv_cache"])
    assert not dummy.is_sleeping() and dummy.engine.get_stats().sleep_level == 0
    assert tokens(dummy) == expected


def test_the_engine_keeps_its_own_copy_of_device_arrays(dummy, expected):
    """Freeing the engine's weights (sleep level 2) leaves the caller's arrays alive,
    and the caller's arrays changing leaves the engine's."""
    arrays = {k: jax.device_put(v) for k, v in tensors_of(dummy).items()}
    dummy.update_weights(arrays)
    dummy.sleep(level=2)
    assert not any(a.is_deleted() for a in arrays.values())
    dummy.wake_up()
    dummy.update_weights(arrays)
    for a in arrays.values():
        a.delete()
    assert tokens(dummy) == expected


def test_partial_update_changes_answers_and_updating_back_restores_them(dummy, expected):
    """One projection of a fused q/k/v leaf (its rows only)."""
    dummy.reload_weights()
    assert tokens(dummy) == expected
    name = "model.layers.0.self_attn.k_proj.weight"
    original = tensors_of(dummy)[name]
    dummy.update_weights({name: original * 3.0})
    assert tokens(dummy) != expected
    dummy.update_weights([(name, original)])
    assert tokens(dummy) == expected


@pytest.mark.parametrize(
    "bad, error",
    [
        ({"model.layers.0.mlp.no_such.weight": np.ones(3, np.float32)}, "no place"),
        ({"model.layers.0.mlp.down_proj.weight": np.ones((3, 3), np.float32)}, "shape"),
        ({"model.norm.weight": np.ones(96, np.int32)}, "dtype int32"),
    ],
    ids=["unknown_name", "wrong_shape", "wrong_dtype"],
)
def test_bad_update_changes_nothing(dummy, expected, bad, error):
    dummy.reload_weights()
    runner = dummy.engine.executor.runner
    leaves = jax.tree_util.tree_leaves(runner.params)
    good = {"model.norm.weight": np.zeros(96, np.float32)}  # would change every answer
    with pytest.raises(CheckpointError, match=error):
        dummy.update_weights({**good, **bad})
    after = jax.tree_util.tree_leaves(runner.params)
    assert all(a is b for a, b in zip(after, leaves, strict=True))
    assert tokens(dummy) == expected


def check_sleep_and_bad_update(llm, want) -> None:
    """sleep(1) / wake_up() and a refused update leave the answers as they were."""
    llm.sleep(level=1)
    llm.wake_up()
    assert tokens(llm) == want
    with pytest.raises(CheckpointError, match="shape"):
        llm.update_weights({"model.layers.1.mlp.up_proj.weight": np.ones((2, 2), np.float32)})
    assert tokens(llm) == want


@pytest.mark.parametrize(
    "layout",
    [{"tensor_parallel_size": 3}, {"pipeline_parallel_size": 2}],
    ids=["tp3", "pp2"],
)
def test_parallel_engine_takes_device_arrays(tiny_smollm2, kwargs, expected, layout):
    """3 tensor devices, or 2 pipeline stages (each takes its layers); the new weights
    are jax.Arrays on another device, resharded on device."""
    device = jax.devices()[5]
    with LLM(
        str(tiny_smollm2[0]), load_format="dummy", enforce_eager=True, **layout, **kwargs
    ) as llm:
        arrays = {k: jax.device_put(v, device) for k, v in tensors_of(llm).items()}
        llm.update_weights(arrays)
        assert tokens(llm) == expected
        check_sleep_and_bad_update(llm, expected)


def test_quantized_engine_requantizes_float_weights(tiny_smollm2, kwargs):
    folder = str(tiny_smollm2[0])
    with LLM(folder, quantization="int8", enforce_eager=True, **kwargs) as loaded:
        want = tokens(loaded)
    with LLM(folder, quantization="int8", load_format="dummy", enforce_eager=True, **kwargs) as llm:
        llm.update_weights(tensors_of(llm))
        assert tokens(llm) == want
        check_sleep_and_bad_update(llm, want)


def test_collective_rpc_and_refusals(dummy, tiny_llm, expected):
    (changed,) = dummy.collective_rpc("reload_weights")
    assert changed > 0
    assert dummy.collective_rpc("is_sleeping") == [False]
    assert tokens(dummy) == expected
    with pytest.raises(ValueError, match="unknown method 'load_model'"):
        dummy.collective_rpc("load_model")
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        tiny_llm.sleep()
    with pytest.raises(ValueError, match="wake_up tags"):
        dummy.wake_up(["everything"])
    dummy.engine.add_request("busy", PROMPTS[0], GREEDY)
    with pytest.raises(RuntimeError, match="still running"):
        dummy.update_weights({})
    dummy.engine.abort_request("busy")
    assert not dummy.engine.has_unfinished_requests()
