"""Multi-LoRA on a tiny random Llama: golden against transformers + peft per adapter,
slot queueing without compiles, prefix-cache isolation, refused adapters, an adapter
deleted while its request waits, TP."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import torch

from jaxengine import LLM, LoRARequest, SamplingParams
from jaxengine.engine_args import EngineArgs
from jaxengine.lora import LoRAAdapterError, LoRAAdapterNotFoundError
from tests.lora.conftest import ENGINE_KWARGS, PROMPTS
from tests.lora_adapters import make_adapter
from tests.models.hf_reference import hf_greedy

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def _generate(llm, prompts, loras, params=GREEDY):
    inputs = [{"prompt_token_ids": p} for p in prompts]
    return llm.generate(inputs, params, lora_request=loras, use_tqdm=False)


def _reference(adapters, tiny_base, name):
    return tiny_base[1] if name is None else adapters[name][1]


def test_mixed_batch_matches_peft(lora_llm, adapters, tiny_base):
    """Base, a1, a2 and a3 in one batch (two slots: a3 waits for one): each request
    gets the greedy tokens of transformers + peft with its adapter."""
    names = [None, "a1", "a2", "a3"]
    loras = [None if n is None else adapters[n][0] for n in names]
    outputs = _generate(lora_llm, PROMPTS, loras)
    for prompt, out, name in zip(PROMPTS, outputs, names, strict=True):
        want = hf_greedy(_reference(adapters, tiny_base, name), prompt, 10)
        assert out.outputs[0].token_ids == want, name
        assert out.lora_request == (None if name is None else adapters[name][0])


def test_prompt_logprobs_match_peft_logits(lora_llm, adapters, tiny_base):
    """Every prompt position's log-probability (logits up to their log-sum-exp) is
    within 1e-4 of transformers + peft, for each adapter in one float32 batch."""
    names = ["a1", "a2", None, "a1"]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    loras = [None if n is None else adapters[n][0] for n in names]
    outputs = _generate(lora_llm, PROMPTS, loras, params)
    for prompt, out, name in zip(PROMPTS, outputs, names, strict=True):
        with torch.no_grad():
            logits = _reference(adapters, tiny_base, name)(torch.tensor([prompt])).logits[0]
        want = torch.log_softmax(logits.double(), -1).numpy()
        got = [out.prompt_logprobs[j][prompt[j]].logprob for j in range(1, len(prompt))]
        expected = [want[j - 1, prompt[j]] for j in range(1, len(prompt))]
        np.testing.assert_allclose(got, expected, atol=1e-4, err_msg=str(name))


def test_more_adapters_than_slots_queue_without_compiling(lora_llm, adapters, tiny_base):
    """Eight requests over four adapters and the base model with two slots: every
    step mixes at most two adapters, swapping them compiles nothing, and each request
    still gets its adapter's tokens."""
    store = lora_llm.engine.executor.runner.lora.store
    seen, assign = [], store.assign

    def watch(requests):
        seen.append({r.lora_int_id for r in requests if r is not None})
        return assign(requests)

    names = ["a1", "a2", "a3", "a4", None, "a4", "a2", "a1"]
    prompts = [PROMPTS[i % 4] for i in range(8)]
    store.assign = watch
    try:
        outputs = _generate(lora_llm, prompts, [adapters[n][0] if n else None for n in names])
    finally:
        del store.assign
    assert max(len(s) for s in seen) == 2 and len(set().union(*seen)) == 4
    for prompt, out, name in zip(prompts, outputs, names, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(
            _reference(adapters, tiny_base, name), prompt, 10
        )
    assert lora_llm.engine.executor.compiles_after_warmup == 0


def test_prefix_cache_keys_include_the_adapter(lora_llm, adapters, tiny_base):
    """A prompt cached by the base model is not reused by an adapter (nor the reverse);
    the same adapter reuses its own pages."""
    prompt = [int(t) for t in np.random.RandomState(9).randint(0, 256, 40)]
    a4 = adapters["a4"][0]
    runs = [None, a4, a4, None]
    cached = []
    for lora in runs:
        (out,) = _generate(lora_llm, [prompt], lora)
        name = None if lora is None else lora.lora_name
        assert out.outputs[0].token_ids == hf_greedy(
            _reference(adapters, tiny_base, name), prompt, 10
        )
        cached.append(out.num_cached_tokens)
    assert cached[0] == 0 and cached[1] == 0  # the adapter's first run: nothing shared
    assert cached[2] > 0 and cached[3] > 0  # each reuses its own


@pytest.fixture(scope="module")
def bad_adapters(tiny_base, tmp_path_factory):
    """name -> (folder, what the error says)."""
    import transformers

    root = tmp_path_factory.mktemp("bad_lora")
    base = tiny_base[1]
    make_adapter(base, root / "rank16", seed=5, r=16)
    other = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    make_adapter(transformers.AutoModelForCausalLM.from_config(other), root / "other", seed=6)
    make_adapter(base, root / "head", seed=7, targets=("lm_head",))
    make_adapter(base, root / "corrupt", seed=8)
    weights = root / "corrupt" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    return {
        "rank16": (root / "rank16", "greater than max_lora_rank 8"),
        "other": (root / "other", "do not fit the model's weight"),
        "head": (root / "head", "lm_head"),
        "corrupt": (root / "corrupt", "corrupt adapter weights"),
        "missing": (root / "nowhere", "failed: No adapter found for .*nowhere"),
    }


@pytest.mark.parametrize("name", ["rank16", "other", "head", "corrupt", "missing"])
def test_bad_adapter_is_refused_and_nothing_else_is_affected(
    lora_llm, adapters, tiny_base, bad_adapters, name
):
    path, message = bad_adapters[name]
    bad = LoRARequest(f"bad-{name}", 90, str(path))
    with pytest.raises(LoRAAdapterError, match=message):
        _generate(lora_llm, PROMPTS[:2], [adapters["a1"][0], bad])
    assert 90 not in lora_llm.list_loras()
    (out,) = _generate(lora_llm, PROMPTS[:1], adapters["a1"][0])
    assert out.outputs[0].token_ids == hf_greedy(adapters["a1"][1], PROMPTS[0], 10)


def test_adapter_deleted_while_its_request_waits_fails_that_request_alone(
    lora_llm, adapters, tiny_base, tmp_path
):
    """An adapter read when its request is queued, then pushed off the host (two
    adapters fit it) by the next requests' adapters, then deleted: its request fails
    alone when it is admitted (vLLM's not-found error, naming the adapter), the base
    and the other adapters' requests finish normally, and the engine keeps serving.
    Admitted requests pin their adapters, so none is read inside a step."""
    folder = shutil.copytree(adapters["a4"][0].lora_path, tmp_path / "gone")
    gone = LoRARequest("gone", 77, str(folder))
    jobs = {"base": None, "gone": gone, "a1": adapters["a1"][0], "a2": adapters["a2"][0]}
    engine = lora_llm.engine
    for i, (rid, lora) in enumerate(jobs.items()):
        engine.add_request(rid, {"prompt_token_ids": PROMPTS[i]}, GREEDY, lora_request=lora)
    store = engine.executor.runner.lora.store
    assert 77 not in store._host  # a1 and a2 were read (or touched) after it
    shutil.rmtree(folder)
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o.outputs[0] for o in engine.step() if o.finished}
    failed = finished.pop("gone")
    assert (failed.finish_reason, failed.token_ids) == ("abort", [])
    assert failed.stop_reason == f"Loading lora gone failed: No adapter found for {folder}"
    for i, (rid, lora) in enumerate(jobs.items()):
        if rid != "gone":
            model = _reference(adapters, tiny_base, None if lora is None else rid)
            assert finished[rid].token_ids == hf_greedy(model, PROMPTS[i], 10), rid
    assert not store._pins  # every finished request gave its pin back
    with pytest.raises(LoRAAdapterNotFoundError):  # a new request for it: refused
        _generate(lora_llm, PROMPTS[:1], gone)
    (out,) = _generate(lora_llm, PROMPTS[:1], adapters["a1"][0])
    assert out.outputs[0].token_ids == hf_greedy(adapters["a1"][1], PROMPTS[0], 10)
    assert lora_llm.remove_lora(77) is True


def test_add_remove_list(lora_llm, adapters):
    a2 = adapters["a2"][0]
    lora_llm.add_lora(a2)
    assert a2.lora_int_id in lora_llm.list_loras()
    assert lora_llm.remove_lora(a2.lora_int_id) is True
    assert a2.lora_int_id not in lora_llm.list_loras()
    assert lora_llm.remove_lora(a2.lora_int_id) is False
    with pytest.raises(ValueError, match="lora_int_id must be an integer > 0"):
        LoRARequest("x", 0, "/nowhere")
    clash = dataclasses.replace(adapters["a1"][0], lora_name="other-name")
    lora_llm.add_lora(adapters["a1"][0])
    with pytest.raises(LoRAAdapterError, match="is 'a1' already"):
        lora_llm.add_lora(clash)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(pipeline_parallel_size=2), "not supported with pipeline parallelism"),
        (dict(model_impl="transformers"), "need the JAX model"),
        (dict(max_loras=4, max_cpu_loras=2), "must be >= max_loras"),
    ],
)
def test_lora_flag_refusals(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model="m", enable_lora=True, **kwargs).create_engine_config()


@pytest.mark.parametrize("fully_sharded", [False, True])
def test_tensor_parallel_matches_one_device(tiny_base, adapters, fully_sharded):
    """Two tensor devices (B split with the projection's outputs, A with o/down's
    inputs; A's slot columns too with --fully-sharded-loras) give the one-device
    tokens."""
    names = [None, "a1", "a3", "a1"]
    loras = [adapters[n][0] if n else None for n in names]
    kwargs = dict(ENGINE_KWARGS, tensor_parallel_size=2, fully_sharded_loras=fully_sharded)
    with LLM(model=tiny_base[0], **kwargs) as llm:
        outputs = _generate(llm, PROMPTS, loras)
        assert llm.engine.executor.compiles_after_warmup == 0
    for prompt, out, name in zip(PROMPTS, outputs, names, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(
            _reference(adapters, tiny_base, name), prompt, 10
        )


def test_async_scheduling_with_adapters(tiny_base, adapters):
    """With --async-scheduling, adapters swapping between steps that are in flight
    still give each request its adapter's tokens."""
    names = ["a1", "a2", "a3", None, "a4", "a1"]
    prompts = [PROMPTS[i % 4] for i in range(len(names))]
    with LLM(model=tiny_base[0], **ENGINE_KWARGS, async_scheduling=True) as llm:
        outputs = _generate(llm, prompts, [adapters[n][0] if n else None for n in names])
        assert llm.engine.executor.compiles_after_warmup == 0
    for prompt, out, name in zip(prompts, outputs, names, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(
            _reference(adapters, tiny_base, name), prompt, 10
        )


def test_data_parallel_replicas_serve_adapters(tiny_base, adapters):
    """Two replicas: each reads the adapters its requests need, outputs unchanged."""
    names = ["a1", "a2", None, "a3", "a1", "a4"]
    prompts = [PROMPTS[i % 4] for i in range(len(names))]
    with LLM(model=tiny_base[0], **ENGINE_KWARGS, data_parallel_size=2) as llm:
        outputs = _generate(llm, prompts, [adapters[n][0] if n else None for n in names])
        assert llm.remove_lora(adapters["a1"][0].lora_int_id) is True
    for prompt, out, name in zip(prompts, outputs, names, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(
            _reference(adapters, tiny_base, name), prompt, 10
        )
