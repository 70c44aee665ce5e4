"""PIECEWISE steps (`runner.piecewise`, the default on CPU) against FULL ones.

A PIECEWISE step runs the embedding, each decoder layer and the head as separate
compiled programs, one program per kind of layer. It must give what the FULL step
(one program, every layer inlined: the accelerators' default) gives: the same greedy
tokens and the same logprobs, through prefill chunks, decode and preemption. Every
other CPU engine test runs PIECEWISE; the golden Pallas condition
(`test_engine_golden.py`) and the parallel-layout checks that build pipelines run FULL
against transformers.
"""

from __future__ import annotations

import copy

import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from jaxengine import LLM, SamplingParams
from jaxengine.models import get_model
from jaxengine.runner.piecewise import Pieces, PiecewiseStage, program_class
from jaxengine.runner.program import SingleStage
from tests.engine.conftest import small_llm_kwargs
from tests.models.test_layer_bodies import KINDS

PROMPTS = [
    "Hi",
    "The history of the printing press begins in the fifteenth century, when",
    "def fibonacci(n):",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30",
]


@pytest.fixture(scope="module")
def full_llm(tiny_smollm2, xla_cache_dir):
    """`tiny_llm`'s engine with ``cudagraph_mode`` FULL."""
    engine = LLM(
        model=str(tiny_smollm2[0]), cudagraph_mode="FULL", **small_llm_kwargs(xla_cache_dir)
    )
    yield engine
    engine.engine.shutdown()


def _program(llm):
    return llm.engine.executor.runner.program


def test_cpu_engines_run_piecewise_unless_told_full(tiny_llm, full_llm):
    program = _program(tiny_llm)
    assert isinstance(program, PiecewiseStage)
    # every bucket: an embedding, one layer program (a Llama's layers are one kind), a head
    assert program._compiled and all(len(kinds) == 1 for _, kinds, _ in program._compiled.values())
    assert type(_program(full_llm)) is SingleStage


def test_same_tokens_and_logprobs_as_the_full_step(tiny_llm, full_llm):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    pieces, full = (
        llm.generate(PROMPTS * 3, params, use_tqdm=False) for llm in (tiny_llm, full_llm)
    )
    for a, b in zip(pieces, full, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert step_a.keys() == step_b.keys()
            got = [step_a[t].logprob for t in step_a]
            np.testing.assert_allclose(got, [step_b[t].logprob for t in step_a], atol=1e-5)
    assert tiny_llm.engine.executor.compiles_after_warmup == 0


def test_one_layer_program_per_kind_of_layer():
    """Gemma 3's sliding-window and full-attention layers are two kinds: two programs,
    each layer called through its own kind's."""
    config = copy.deepcopy(KINDS["gemma3"][0])  # the shared-body check's model
    config.layer_types = ["sliding_attention"] * 2 + ["full_attention", "sliding_attention"]
    module, _ = get_model(config, jnp.float32)
    pieces = Pieces(module, None, with_logits=True)
    assert len(pieces.layers) == 2
    assert pieces.kind_of == [0, 0, 1, 0]


def test_piecewise_needs_a_decoder_stack(tiny_llm):
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=48, architectures=["BertForSequenceClassification"],
    )  # fmt: skip
    bert, _ = get_model(config, jnp.float32)
    plan = _program(tiny_llm).plan
    assert program_class(bert, None, plan) is SingleStage  # auto: FULL
    with pytest.raises(ValueError, match="PIECEWISE is not supported for Bert"):
        program_class(bert, "PIECEWISE", plan)
    with pytest.raises(ValueError, match="cudagraph_mode.*FULL_AND_PIECEWISE"):
        LLM(model="unused", cudagraph_mode="FULL_AND_PIECEWISE")
