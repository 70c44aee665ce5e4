"""An engine-level golden check for a model family: `LLM.generate` against transformers.

Three steps, used by `tests/models/test_new_families_engine.py` (and any family test):

- `save_tiny(hf_config, path)`: a seeded random transformers model saved as safetensors;
- `reference(path, prompts, max_tokens)`: transformers' float32 greedy tokens and each
  step's top-5 logprobs, every step a full-sequence forward (no HF KV cache);
- `check_engine(path, ref, prompts, **engine_kwargs)`: the same prompts through one
  `jaxengine.LLM` (token-id prompts, float32) whose settings force chunked prefill
  (a token budget smaller than a prompt), preemption (few KV pages) and a
  prefix-cache hit (the prompts submitted again in a second `generate` call); each
  condition is asserted to have happened through the engine's own counters
  (`SchedulerStats`), greedy tokens must equal the reference's, each step's top-5
  logprobs must have the same ids and values within `LOGPROB_TOL`, and the executor
  must count no compilation after warm-up. ``engine_kwargs`` go to `LLM` as they
  are (``tensor_parallel_size=2``, ``enable_expert_parallel=True``, ...), so one check
  covers every layout on the 8 virtual CPU devices of `tests/conftest.py`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from tests.models.hf_reference import reference_threads

TOP = 5
LOGPROB_TOL = 1e-4
BLOCK_SIZE = 8
TOKEN_BUDGET = 32
"""``max_num_batched_tokens``: `check_engine` needs one prompt longer than this."""
ENGINE_KWARGS = dict(
    skip_tokenizer_init=True,
    dtype="float32",
    block_size=BLOCK_SIZE,
    max_model_len=64,
    max_num_seqs=4,
    max_num_batched_tokens=TOKEN_BUDGET,
    compile_token_buckets=[TOKEN_BUDGET],
    enable_prefix_caching=True,
    enable_chunked_prefill=True,
    enable_compilation_cache=False,
    swap_space=0,
)
"""What every checked engine gets (a caller's ``engine_kwargs`` override them)."""


def default_prompts(vocab_size: int) -> list[list[int]]:
    """Four token-id prompts for `check_engine`: lengths 37 (longer than the token
    budget: chunked), 9, 22 and 30; the fourth shares the first's 24-token prefix."""
    rng = np.random.RandomState(0)
    first = rng.randint(0, vocab_size, 37).tolist()
    return [
        first,
        rng.randint(0, vocab_size, 9).tolist(),
        rng.randint(0, vocab_size, 22).tolist(),
        first[:24] + rng.randint(0, vocab_size, 6).tolist(),
    ]


def save_tiny(hf_config: Any, path: str | Path, init_range: float | None = 0.2) -> str:
    """A random transformers model of ``hf_config`` (seed 0, float32) saved with
    ``save_pretrained`` (safetensors) into ``path``; returns the folder.

    ``init_range`` replaces the config's ``initializer_range`` (None keeps it): at
    the default 0.02 a tiny model's logits are nearly flat, so different prompts give
    the same greedy tokens and top-5 lists hold near-ties."""
    if init_range is not None:
        hf_config.initializer_range = init_range
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config).float().eval()
    model.save_pretrained(path)
    return str(path)


@dataclasses.dataclass(frozen=True)
class Reference:
    """transformers' greedy continuation of each prompt."""

    tokens: list[list[int]]
    """Per prompt, the greedy tokens."""
    top: list[list[dict[int, float]]]
    """Per prompt and step, the top-`TOP` token ids -> float32 logprobs."""


def reference(path: str | Path, prompts: list[list[int]], max_tokens: int) -> Reference:
    """Greedy tokens and top-5 logprobs of transformers' float32 model at ``path``,
    each step a full forward of the whole sequence so far (no KV cache). Raises when
    a step's best two tokens (or its 5th and 6th) are within `LOGPROB_TOL`: the
    engine's float32 rounding could then pick the other one, and the check would fail
    for no bug; change the prompts or the model's seed."""
    reference_threads()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens, tops = [], []
    for prompt in prompts:
        seq, top = list(prompt), []
        for _ in range(max_tokens):
            with torch.no_grad():
                logits = model(torch.tensor([seq])).logits[0, -1].float()
            logprobs = torch.log_softmax(logits, -1)
            values, ids = torch.topk(logprobs, TOP + 1)
            gaps = (values[0] - values[1], values[TOP - 1] - values[TOP])
            if min(gaps) < LOGPROB_TOL:
                raise AssertionError(f"near-tie in the reference at {len(seq)} tokens: {gaps}")
            top.append(dict(zip(ids[:TOP].tolist(), values[:TOP].tolist(), strict=True)))
            seq.append(int(ids[0]))
        tokens.append(seq[len(prompt) :])
        tops.append(top)
    return Reference(tokens, tops)


def check_engine(path: str | Path, ref: Reference, prompts: list[list[int]], **engine_kwargs):
    """``prompts`` through `jaxengine.LLM` twice (the second call reversed: prefix-cache
    hits, another batch order), each output equal to ``ref`` (see the module
    docstring). Needs a prompt longer than `TOKEN_BUDGET`, and KV pages few enough
    (``num_gpu_blocks_override``, 12 by default) that the four requests cannot all run
    at once. Returns the engine's final `SchedulerStats`."""
    from jaxengine import LLM, SamplingParams

    assert max(len(p) for p in prompts) > TOKEN_BUDGET, "no prompt is long enough to chunk"
    kwargs = {**ENGINE_KWARGS, "num_gpu_blocks_override": 12, **engine_kwargs}
    llm = LLM(str(path), **kwargs)
    try:
        executor = llm.engine.executor
        compiles = executor.compiles_after_warmup
        params = SamplingParams(
            temperature=0, logprobs=TOP, max_tokens=len(ref.tokens[0]), ignore_eos=True
        )
        _generate_and_compare(llm, params, prompts, ref, range(len(prompts)))
        first = llm.engine.get_stats()
        assert first.num_preemptions > 0, "no request was preempted: give fewer KV pages"
        _generate_and_compare(llm, params, prompts, ref, reversed(range(len(prompts))))
        second = llm.engine.get_stats()
        assert second.prefix_cache_hits > first.prefix_cache_hits, "no prefix-cache hit"
        assert executor.compiles_after_warmup == compiles, "compiled after warm-up"
        return second
    finally:
        llm.engine.shutdown()


def _generate_and_compare(llm, params, prompts, ref: Reference, order) -> None:
    """One `generate` of ``prompts`` in ``order``; tokens exact, top logprobs close."""
    order = list(order)
    requests = [{"prompt_token_ids": prompts[i]} for i in order]
    outputs = llm.generate(requests, params, use_tqdm=False)
    for i, out in zip(order, outputs, strict=True):
        got = out.outputs[0]
        assert list(got.token_ids) == ref.tokens[i], f"prompt {i}: greedy tokens differ"
        for step, (entry, want) in enumerate(zip(got.logprobs, ref.top[i], strict=True)):
            top = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:TOP]
            got_top = {t: lp.logprob for t, lp in top}
            assert set(got_top) == set(want), f"prompt {i}, step {step}: top-{TOP} ids differ"
            error = max(abs(got_top[t] - want[t]) for t in want)
            assert error <= LOGPROB_TOL, f"prompt {i}, step {step}: logprob error {error:.2e}"
