"""The whole engine against transformers: greedy tokens exact.

16 prompts of mixed lengths, some sharing long prefixes, through `LLM.generate` under
each scheduling condition (chunked prefill on/off, prefix caching on/off, a KV cache
small enough to force preemption by recompute and by swap, max_num_seqs 1 and 16,
async scheduling, speculative decoding with n-gram proposals, a draft model and an
EAGLE head, tensor and pipeline parallelism). The same again with
`--attention-backend pallas` (on CPU the Pallas GPU kernels run in interpret mode
inside the compiled step).

The default model (SmolLM2, real weights) runs the default condition (the real-model
golden) and n-gram speculation (`REAL_MODEL`). Every other condition is about
scheduling, not the weights, and runs on a tiny random Llama with SmolLM2's tokenizer
and vocabulary (2 layers, 6 query / 3 KV heads, so tensor parallelism over 3 devices
splits it as it splits SmolLM2's 9/3): its step compiles in about a second where
SmolLM2's 30 layers take eight. All engines share a persistent compilation cache, so
identical shapes compile once.
"""

from __future__ import annotations

import logging

import pytest

from jaxengine import LLM, SamplingParams
from tests.models.hf_reference import hf_greedy_batch

NEW_TOKENS = 24
PREAMBLE = (
    "You are a careful assistant. Answer briefly and precisely, and never invent facts. "
    "If a question is ambiguous, say so. "
)
QUESTIONS = [
    "What is the capital of Italy?",
    "Name a mammal that can fly.",
    "How many legs does a spider have?",
    "What colour is the sky on a clear day?",
    "Who painted the Mona Lisa?",
    "What is the boiling point of water in Celsius?",
    "Which planet is known as the red planet?",
    "What is the square root of 81?",
]
OTHERS = [
    "Hi",
    "The history of the printing press begins",
    "def fibonacci(n):",
    "Once upon a time there was a little robot who wanted to learn how to paint the sunset",
    "1 2 3 4 5",
    "Paris is",
    "A long list of fruits: apple, banana, cherry, date, elderberry, fig, grape, honeydew,",
    "Q: Why is the sea salty?\nA:",
]


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    texts = [PREAMBLE + q for q in QUESTIONS] + OTHERS
    return [smollm2_tokenizer.encode(t) for t in texts]


@pytest.fixture(scope="module")
def tiny(tiny_smollm2):
    """(folder, transformers model): the session's tiny model (`tests/conftest.py`)."""
    return tiny_smollm2


@pytest.fixture(scope="module")
def reference(request):
    """(model folder or file, transformers model) of the default model or the tiny one."""

    def get(name: str):
        if name == "smollm2":
            return request.getfixturevalue("smollm2_gguf"), request.getfixturevalue("smollm2_hf")
        return request.getfixturevalue("tiny")

    return get


@pytest.fixture(scope="module")
def expected(prompts, reference):
    """name -> transformers' greedy tokens for every prompt, computed once per model."""
    made = {}

    def get(name: str):
        if name not in made:
            model = reference(name)[1]
            made[name] = hf_greedy_batch(model, prompts, NEW_TOKENS)
        return made[name]

    return get


BASE = dict(
    max_model_len=256,
    max_num_seqs=16,
    max_num_batched_tokens=64,
    compile_token_buckets=[16, 64],
    num_gpu_blocks_override=16 * 16 + 1,
    swap_space=0,
)
CONDITIONS = {
    "default": {},
    "no_chunked_prefill": dict(
        enable_chunked_prefill=False,
        max_num_batched_tokens=256,
        compile_token_buckets=[16, 64, 256],
    ),
    "no_prefix_caching": dict(enable_prefix_caching=False),
    "max_num_seqs_1": dict(max_num_seqs=1, compile_token_buckets=[1, 16, 64]),
    # the Pallas kernels inside the real step (interpret mode on CPU), compiled FULL as
    # on the accelerators the kernels are for (every other condition: PIECEWISE, the
    # CPU default; `test_piecewise.py` checks the two agree)
    "pallas_kernels": dict(attention_backend="pallas", cudagraph_mode="FULL"),
    # the next step scheduled while the device runs the previous one, its in-flight
    # tokens fed on device, over 3 tensor devices, with pages swapped out and back
    "async_preempt_swap_tp3": dict(
        num_gpu_blocks_override=41, swap_space=1, tensor_parallel_size=3, async_scheduling=True
    ),
    # n-gram proposals (speculative decoding) verified by the model, with preemption by
    # recompute (as the draft-model and EAGLE runs: no plain "preempt_recompute" run
    # repeats the scheduler's recompute path)
    "ngram_preempt_recompute": dict(
        num_gpu_blocks_override=24,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
        },
    ),  # fmt: skip
    # a draft model (SmolLM2 cut to its first 8 layers) proposing, with preemption
    "draft_model_preempt_recompute": dict(num_gpu_blocks_override=24),
    # a random one-layer EAGLE head on SmolLM2's hidden states proposing, with
    # preemption: its drafts are rarely right, the outputs the same
    "eagle_preempt_recompute": dict(num_gpu_blocks_override=24),
    # 6 heads / 3 KV heads over 3 tensor devices, 2 layers over 2 stages (6 of the 8
    # virtual CPU devices), with pages swapped out and back across both stages (the
    # synchronous swap path: no separate one-device "preempt_swap" run repeats it)
    "preempt_swap_tp3_pp2": dict(
        num_gpu_blocks_override=41,
        swap_space=1,
        tensor_parallel_size=3,
        pipeline_parallel_size=2,
    ),
}


@pytest.fixture(scope="module")
def tiny_truncated(tiny, tmp_path_factory):
    """A draft model: the tiny model's embeddings, first layer and norm, as a HF folder."""
    import copy

    import transformers

    target = tiny[1]
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = 1
    draft = transformers.AutoModelForCausalLM.from_config(config)
    state = {k: v for k, v in target.state_dict().items() if _layer(k) < 1}
    draft.load_state_dict(state, strict=False)
    path = tmp_path_factory.mktemp("tiny_draft")
    draft.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_eagle(tiny, tmp_path_factory):
    """A random EAGLE head for the tiny model in the EAGLE layout (fc, one layer without
    its input norm; the target's embedding shared)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**tiny[1].config.to_dict(), "num_hidden_layers": 1})
    head = transformers.LlamaModel(config)
    skip = ("norm.", "embed_tokens.", "layers.0.input_layernorm")
    tensors = {k: v for k, v in head.state_dict().items() if not k.startswith(skip)}
    width = config.hidden_size
    tensors["fc.weight"] = torch.randn(width, 2 * width) * 0.02
    path = tmp_path_factory.mktemp("tiny_eagle")
    save_file(tensors, path / "model.safetensors")
    config.save_pretrained(path)
    return path


USERS = {
    "type": "array",
    "minItems": 4,
    "maxItems": 4,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
        },
        "required": ["name", "id"],
        "additionalProperties": False,
    },
}


def _check_json_with_proposals(llm) -> None:
    """A JSON-schema request with n-gram proposals: the grammar cuts the proposals it
    does not allow and masks each verified position; the output is valid and the
    repeated keys were accepted from proposals."""
    import json

    import jsonschema

    from jaxengine.sampling_params import StructuredOutputsParams

    before = llm.engine.get_stats().spec_decoding.num_accepted_tokens
    params = SamplingParams(
        temperature=0, max_tokens=160, structured_outputs=StructuredOutputsParams(json=USERS)
    )
    (out,) = llm.generate(["A list of four users as JSON:"], params, use_tqdm=False)
    jsonschema.validate(json.loads(out.outputs[0].text), USERS)
    assert llm.engine.get_stats().spec_decoding.num_accepted_tokens - before > 10


REAL_MODEL = ("default", "ngram_preempt_recompute")
"""Conditions run on SmolLM2's real weights; the others run on the tiny model. n-gram
proposals need text that repeats itself, which SmolLM2 writes and a random model does
not (on the tiny model no n-gram is ever proposed)."""

PROMPT_STRIDE = {"max_num_seqs_1": 4}
"""Conditions that run every n-th prompt only: one request at a time takes a step per
token, and four prompts (two sharing the preamble) show that as well as sixteen."""


def _layer(name: str) -> int:
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else -1


@pytest.mark.slow
@pytest.mark.parametrize("condition", sorted(CONDITIONS))
def test_greedy_matches_transformers(
    condition, prompts, expected, reference, xla_cache_dir, caplog, request
):
    kwargs = {**BASE, **CONDITIONS[condition], "compilation_cache_dir": xla_cache_dir}
    model = "smollm2" if condition in REAL_MODEL else "tiny"
    if condition.startswith("draft_model"):
        draft = request.getfixturevalue("tiny_truncated")
        kwargs["speculative_config"] = {"model": str(draft), "num_speculative_tokens": 3}
    if condition.startswith("eagle"):
        head = request.getfixturevalue("tiny_eagle")
        kwargs["speculative_config"] = {
            "method": "eagle", "model": str(head), "num_speculative_tokens": 3
        }  # fmt: skip
    with caplog.at_level(logging.INFO, logger="jaxengine.executor.build"):
        llm = LLM(model=str(reference(model)[0]), **kwargs)
    backend = "pallas-gpu-interpret" if condition == "pallas_kernels" else "xla-cpu"
    assert f"attention backend: {backend}" in caplog.text
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    every = PROMPT_STRIDE.get(condition, 1)
    prompts, expected = prompts[::every], expected(model)[::every]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, (out, want) in enumerate(zip(outputs, expected, strict=True)):
        assert list(out.outputs[0].token_ids) == want, f"{condition}: prompt {i * every}"
    stats = llm.engine.get_stats()
    if "preempt" in condition:
        assert stats.num_preemptions > 0
    if condition == "default":
        assert stats.prefix_cache_hits > 0
    if condition.startswith(("ngram", "draft_model")):
        assert stats.spec_decoding.num_accepted_tokens > 0
    if condition.startswith("eagle"):
        assert stats.spec_decoding.num_draft_tokens > 0
    if condition.startswith("ngram"):
        _check_json_with_proposals(llm)
    assert llm.engine.executor.compiles_after_warmup == 0
    assert stats.kv_cache_usage == 0.0  # every page back
    llm.engine.shutdown()
