"""Custom logits processors without an engine: loading by qualified name and the
refusals, the batch updates the runner hands them, the flag, the config's
refusals, and the server's ``vllm_xargs`` reaching ``SamplingParams.extra_args``.
(The processors in the compiled sampler: tests/engine/test_logits_processors.py.)"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from jaxengine.config.arg_utils import FlexibleArgumentParser
from jaxengine.engine_args import EngineArgs
from jaxengine.logits_processor import LogitsProcessor, resolve_logits_processors
from jaxengine.runner.logits_processors import ProcessorBatch
from jaxengine.runner.sampling_metadata import SamplingRow
from jaxengine.sampling_params import SamplingParams
from jaxengine.worker.build import logits_processors
from server.chat.protocol import ChatCompletionRequest
from server.completions.protocol import CompletionRequest
from tests.example_logits_processors import (
    InvariantTargetProcessor,
    TargetTokenProcessor,
    TorchStyleProcessor,
)

MODULE = "tests.example_logits_processors"


# ---------------------------------------------------------------------- loading


@pytest.mark.parametrize(
    "name", [f"{MODULE}:TargetTokenProcessor", f"{MODULE}.TargetTokenProcessor"]
)
def test_a_processor_loads_by_qualified_name(name):
    assert resolve_logits_processors([name]) == (TargetTokenProcessor,)


def test_classes_are_taken_as_they_are():
    classes = resolve_logits_processors(
        [InvariantTargetProcessor, f"{MODULE}:TargetTokenProcessor"]
    )
    assert classes == (InvariantTargetProcessor, TargetTokenProcessor)
    assert resolve_logits_processors(None) == ()


@pytest.mark.parametrize(
    "entry, message",
    [
        (
            f"{MODULE}:TorchStyleProcessor",
            f"{MODULE}:TorchStyleProcessor is not a JAX logits processor \\(its apply\\(logits\\) "
            "takes no state: vLLM's torch form\\).*must subclass "
            "jaxengine.logits_processor.LogitsProcessor",
        ),
        (TorchStyleProcessor, "TorchStyleProcessor is not a JAX logits processor"),
        ("jaxengine.logits_processor:qualified_name", "not a class \\(function\\)"),
        (f"{MODULE}:Missing", f"{MODULE} has no Missing"),
        ("no_such_package.mod:Cls", "cannot import no_such_package.mod"),
        ("Cls", "not a qualified class name"),
    ],
)
def test_what_is_not_a_jax_processor_is_refused_naming_it(entry, message):
    with pytest.raises(ValueError, match=message):
        resolve_logits_processors([entry])


def test_an_incomplete_processor_is_refused():
    class NoState(LogitsProcessor):
        def __init__(self, vllm_config, device, is_pin_memory):
            pass

        def is_argmax_invariant(self):
            return False

        def update_state(self, batch_update):
            pass

        def apply(self, logits, state):
            return logits

    with pytest.raises(ValueError, match="NoState does not define state"):
        resolve_logits_processors([NoState])


# ---------------------------------------------------------------------- the flag


def parse(*argv: str):
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    return EngineArgs.from_cli_args(parser.parse_args(list(argv)))


def test_the_flag_takes_qualified_names():
    names = [f"{MODULE}:TargetTokenProcessor", f"{MODULE}.InvariantTargetProcessor"]
    args = parse("--logits-processors", *names)
    assert args.logits_processors == names
    config = args.create_engine_config()
    assert config.model_config.logits_processors == names
    assert parse().logits_processors is None


def test_the_config_travels_by_name_and_each_worker_imports_it():
    """What crosses a process boundary (pickle: multi-host, Ray) names the classes;
    the worker's build imports them and makes one instance each."""
    config = EngineArgs(
        logits_processors=[f"{MODULE}:TargetTokenProcessor", InvariantTargetProcessor]
    ).create_engine_config()
    config = pickle.loads(pickle.dumps(config))
    batch = logits_processors(config, None, None)
    assert [type(p) for p in batch.processors] == [TargetTokenProcessor, InvariantTargetProcessor]
    assert logits_processors(EngineArgs().create_engine_config(), None, None) is None


def test_refused_with_speculative_decoding_and_pooling():
    with pytest.raises(ValueError, match="not supported with speculative decoding"):
        EngineArgs(
            logits_processors=[TargetTokenProcessor],
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
    config = EngineArgs(logits_processors=[TargetTokenProcessor]).create_engine_config()
    with pytest.raises(ValueError, match="Pooling models do not support custom logits"):
        logits_processors(config, object(), None)


# ---------------------------------------------------------------------- batch updates


def row(extra=None, out=(), prompt=(1, 2)) -> SamplingRow:
    return SamplingRow(SamplingParams(extra_args=extra), list(out), list(prompt), seed=0)


def test_batch_updates_follow_the_rows():
    proc = TargetTokenProcessor(None, None, False)
    batch = ProcessorBatch([proc])
    a, b = row({"target_token": 7}, out=[1]), row(out=[2, 3])
    (state,) = batch.step(["a", "b", None], [a, b, None], 4)
    np.testing.assert_array_equal(state, [7, -1, -1, -1])
    (update,) = proc.updates
    assert update.batch_size == 3 and update.removed == [] and update.moved == []
    assert [(i, out) for i, _, _, out in update.added] == [(0, [1]), (1, [2, 3])]
    live = update.added[0][3]
    # the same rows: no update, but the live output list grows
    rows = [row({"target_token": 7}, out=[1, 5]), row(out=[2, 3, 4]), None]
    batch.step(["a", "b", "x"], rows, 4)
    assert len(proc.updates) == 1 and live == [1, 5]
    # "a" finished: "b" moves to index 0 (removed + added), a new request at 1
    (state,) = batch.step(["b", "c"], [row(out=[2, 3, 4]), row({"target_token": 9})], 2)
    np.testing.assert_array_equal(state, [-1, 9])
    update = proc.updates[-1]
    assert update.removed == [0, 1] and [i for i, *_ in update.added] == [0, 1]
    # a row that samples nothing this step (mid-prefill) is not in the batch
    batch.step(["b", "d"], [row(out=[2, 3, 4]), None], 2)
    assert proc.updates[-1].removed == [1] and proc.updates[-1].added == []


def test_a_state_whose_shape_drifts_is_an_error_naming_the_processor():
    class Drifting(TargetTokenProcessor):
        def state(self, num_rows):
            return np.zeros(num_rows + len(self.targets), np.int32)

    batch = ProcessorBatch([Drifting(None, None, False)])
    assert batch.template(4)[0].shape == (4,)
    with pytest.raises(ValueError, match="Drifting: state\\(4\\) changed shape or dtype"):
        batch.step(["a"], [row({"target_token": 1})], 4)


# ---------------------------------------------------------------------- the server


def test_vllm_xargs_become_extra_args():
    request = CompletionRequest(prompt="Hi", vllm_xargs={"target_token": 5, "x": "y"})
    params = request.sampling_params(4, None, {})
    assert params.extra_args == {"target_token": 5, "x": "y"}
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}])
    assert chat.sampling_params(4, None, {}).extra_args is None
