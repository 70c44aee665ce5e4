"""Start-up: compiling in the background while serving, and restarting from stored
executables, change no output and leave nothing to compile after warm-up."""

from __future__ import annotations

from collections import Counter

import pytest

from jaxengine import LLM, SamplingParams
from jaxengine.runner import executables
from jaxengine.runner.executables import ExecutableStore
from tests.engine.conftest import small_llm_kwargs

PROMPTS = [{"prompt_token_ids": [(13 * i + j) % 4000 + 20 for j in range(n)]} for i, n in
           enumerate((5, 40, 17, 2))]  # fmt: skip
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.slow
def test_background_compile_then_a_restart_from_stored_executables(
    tiny_smollm2, xla_cache_dir, tmp_path, monkeypatch
):
    model = str(tiny_smollm2[0])  # the stored programs, not the weights, are under test
    # token and request buckets no other test compiles (R = 3, 6), so neither JAX's
    # persistent cache nor its in-memory one (the sampler's bitmask program depends on R
    # and the vocabulary alone) can answer them: the first engine compiles, and stores,
    # every program itself
    kwargs = {
        **small_llm_kwargs(xla_cache_dir),
        "max_num_seqs": 6,
        "compile_token_buckets": [3, 12, 32],
        "compilation_cache_dir": str(tmp_path),
    }
    first = LLM(model=model, background_compile=True, **kwargs)
    runner = first.engine.executor.runner
    expected = [o.outputs[0].token_ids for o in first.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert runner.compiles.wait(600) and runner.guard.armed
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=9, logprobs=2)
    first.generate(PROMPTS[::-1], sampled, use_tqdm=False)
    assert first.engine.executor.compiles_after_warmup == 0
    first.engine.shutdown()
    stored = Counter(p.name.split("-")[0] for p in (tmp_path / "executables").iterdir())
    unmasked = sum(not f.token_bitmask for f in runner.sampler.variants)
    # per token bucket the PIECEWISE step's pieces (`runner.piecewise`: the CPU default)
    # and the prompt logprobs; per request bucket (R = 3, 6) every sampler variant
    # without the grammar bitmask, and the bitmask's program (the masked variants run it
    # before their unmasked twin)
    pieces = {"step.embed": 3, "step.layer0": 3, "step.head": 3}
    samplers = {"sampler": 2 * unmasked, "sampler.mask": 2}
    assert stored == {**pieces, "prompt_logprobs": 3, **samplers}

    # a restart is a new process: none of the first engine's executables in memory
    # (`executables.process_shared` would hand its sampler programs to the second)
    monkeypatch.setattr(executables, "_shared", type(executables._shared)())
    loaded = []
    load = ExecutableStore.load
    monkeypatch.setattr(
        ExecutableStore, "load", lambda self, *a: loaded.append(load(self, *a)) or loaded[-1]
    )
    second = LLM(model=model, **kwargs)  # blocking warm-up, from the store
    assert len(loaded) == stored.total() and all(x is not None for x in loaded)
    got = [o.outputs[0].token_ids for o in second.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == expected
    assert second.engine.executor.compiles_after_warmup == 0
    second.engine.shutdown()
