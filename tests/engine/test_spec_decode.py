"""Speculative decoding on a tiny random Llama: the same tokens as without it.

Engines over one checkpoint without ``--speculative-config``, with n-gram proposals,
and with a draft model (the checkpoint cut to its first layer): greedy
and seeded sampling give the same tokens (and logprobs) whatever is accepted, the
prefix cache only ever holds accepted tokens, a stop token inside an accepted run
ends the output where it would have, preemption changes nothing, and unseeded
sampling follows the target's distribution exactly (chi-square against the joint
distribution of the first three tokens, computed with transformers). The LM head is
scaled so the random model has peaked, repetitive continuations that the n-gram
proposals often match. The golden test on the real SmolLM2 is a condition of
`test_engine_golden`.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file
from scipy import stats
from tiny_models import tiny_llama_config

from jaxengine import LLM, SamplingParams
from jaxengine.speculative.device.eagle import EagleProposer

VOCAB = 64
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 4}  # fmt: skip
KWARGS = dict(
    skip_tokenizer_init=True,
    max_model_len=128,
    max_num_seqs=8,
    max_num_batched_tokens=32,
    compile_token_buckets=[8, 32],
    enable_compilation_cache=False,
    swap_space=0,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint folder, transformers model): 2 layers, LM head scaled by 40."""
    config = tiny_llama_config(VOCAB)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    path = tmp_path_factory.mktemp("spec_tiny")
    model.save_pretrained(path)
    draft_config = copy.deepcopy(config)
    draft_config.num_hidden_layers = 1
    draft = transformers.AutoModelForCausalLM.from_config(draft_config).eval()
    state = {k: v for k, v in model.state_dict().items() if "layers.1." not in k}
    draft.load_state_dict(state)
    draft.save_pretrained(path / "draft")
    _save_head(path / "eagle", config, _mimic_head(model))
    return str(path), model


def _save_head(path: Path, config, tensors: dict) -> None:
    """An EAGLE-layout checkpoint: ``tensors`` and a config of ``config``'s family
    with as many layers as the tensors have."""
    layers = len({k.split(".")[1] for k in tensors if k.startswith("layers.")})
    path.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors")
    transformers.LlamaConfig(**{**config.to_dict(), "num_hidden_layers": layers}).save_pretrained(
        path
    )


def _mimic_head(model) -> dict:
    """An EAGLE head that drafts much as the target would: the target's layers (the
    first without its input norm, its q/k/v scaled by the embeddings' mean RMS in its
    place), fed the token embedding alone (fc = [I | 0]), the target's embedding
    shared (none in the checkpoint). Its drafts are often accepted, often not."""
    state = model.state_dict()
    rms = state["model.embed_tokens.weight"].pow(2).mean(-1).sqrt().mean()
    head = {}
    for name, value in state.items():
        if not name.startswith("model.layers.") or ".0.input_layernorm" in name:
            continue
        if name.startswith("model.layers.0.self_attn.") and name.split(".")[-2] != "o_proj":
            value = value / rms
        head[name[len("model.") :]] = value.clone()
    width = model.config.hidden_size
    head["fc.weight"] = torch.cat([torch.eye(width), torch.zeros(width, width)], 1)
    return head


def spec_config(tiny, method: str) -> dict:
    if method == "ngram":
        return NGRAM
    folder = "eagle" if method == "eagle" else "draft"
    return {"model": str(Path(tiny[0]) / folder), "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def prompts(tiny):
    """A prompt ending inside the model's own repetitive continuation (proposals are
    accepted often), random ones, and one longer than a step's budget."""
    _, model = tiny
    rs = np.random.RandomState(0)
    start = torch.tensor([rs.randint(0, VOCAB, 12)])
    with torch.no_grad():
        greedy = model.generate(start, max_new_tokens=14, do_sample=False)[0].tolist()
    random = [rs.randint(0, VOCAB, n).tolist() for n in (5, 20, 60)]
    return [greedy, *random, greedy[:20]]


@pytest.fixture(scope="module")
def ref(tiny):
    llm = LLM(tiny[0], **KWARGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module", params=["ngram", "draft_model", "eagle"])
def spec(request, tiny):
    config = spec_config(tiny, request.param)
    llm = LLM(tiny[0], speculative_config=config, disable_log_stats=False, **KWARGS)
    yield llm
    assert llm.engine.executor.compiles_after_warmup == 0
    llm.shutdown()


def _run(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def _accepted(llm) -> int:
    return llm.engine.get_stats().spec_decoding.num_accepted_tokens


def test_greedy_tokens_are_those_without_speculation(ref, spec, prompts):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    before = _accepted(spec)
    assert _run(spec, prompts, params) == _run(ref, prompts, params)
    assert _accepted(spec) - before > 20  # proposals were accepted, not just tried


def test_seeded_sampling_and_logprobs_are_those_without_speculation(ref, spec, prompts):
    params = [
        SamplingParams(n=2, temperature=0.8, top_k=20, top_p=0.9, seed=s, max_tokens=30,
                       logprobs=3, ignore_eos=True)
        for s in range(len(prompts))
    ]  # fmt: skip
    gen = [{"prompt_token_ids": p} for p in prompts]
    want = ref.generate(gen, params, use_tqdm=False)
    got = spec.generate(gen, params, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        for wc, gc in zip(w.outputs, g.outputs, strict=True):
            assert list(gc.token_ids) == list(wc.token_ids)
            for wl, gl in zip(wc.logprobs, gc.logprobs, strict=True):
                assert wl.keys() == gl.keys()
                for token, entry in wl.items():
                    assert gl[token].logprob == pytest.approx(entry.logprob, abs=1e-4)
                    assert gl[token].rank == entry.rank


def test_prefix_cache_holds_only_accepted_tokens(ref, spec, prompts):
    """A second request whose prompt is the first one's prompt and output reuses the
    pages of those outputs: rejected proposals written there would change it."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    (first,) = spec.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    follow = prompts[0] + list(first.outputs[0].token_ids)[:34] + [7]
    (got,) = spec.generate([{"prompt_token_ids": follow}], params, use_tqdm=False)
    assert got.num_cached_tokens >= 48  # three full pages of the first request
    assert _run(ref, [follow], params) == [[list(got.outputs[0].token_ids)]]


def test_a_stop_token_inside_an_accepted_run(ref, spec, prompts):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    (full,) = _run(ref, [prompts[0]], params)[0]
    stop = full[6]
    params = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop])
    got = _run(spec, [prompts[0]], params)
    assert got == _run(ref, [prompts[0]], params)
    assert got[0][0][-1] == stop and len(got[0][0]) <= 7


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
def test_preemption_changes_nothing(tiny, ref, prompts, method):
    """A KV cache of 12 pages for five requests of up to 7 pages: requests are
    preempted (recompute) with proposals pending."""
    config = spec_config(tiny, method)
    llm = LLM(tiny[0], speculative_config=config, num_gpu_blocks_override=12,
              **{**KWARGS, "max_model_len": 112})  # fmt: skip
    try:
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        assert _run(llm, prompts, params) == _run(ref, prompts, params)
        stats = llm.engine.get_stats()
        assert stats.num_preemptions > 0 and stats.spec_decoding.num_accepted_tokens > 0
        assert stats.kv_cache_usage == 0.0
    finally:
        llm.shutdown()


def _joint_probs(model, prompt: list[int], temperature: float) -> np.ndarray:
    """p(t0, t1, t2) [V, V, V] after ``prompt`` at ``temperature``, exactly."""
    with torch.no_grad():
        p0 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        seqs = torch.tensor([prompt + [a] for a in range(VOCAB)])
        p1 = torch.softmax(model(seqs).logits[:, -1] / temperature, -1)  # [V, V]
        pairs = list(itertools.product(range(VOCAB), repeat=2))
        seqs = torch.tensor([prompt + [a, b] for a, b in pairs])
        p2 = torch.softmax(model(seqs).logits[:, -1] / temperature, -1).reshape(VOCAB, VOCAB, -1)
    joint = p0[:, None, None] * p1[:, :, None] * p2
    return joint.double().numpy()


def test_sampling_follows_the_target_distribution(tiny, spec, prompts):
    """2000 unseeded samples of the first three tokens, with proposals verified at
    the second and third: chi-square against the exact joint distribution (cells
    expected below 5 pooled)."""
    n, temperature = 2000, 1.0
    prompt = prompts[0]
    before = spec.engine.get_stats().spec_decoding
    params = SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True)
    outs = _run(spec, [prompt] * n, params)
    after = spec.engine.get_stats().spec_decoding
    assert after.num_accepted_tokens - before.num_accepted_tokens > n // 20  # paths exercised
    expected = _joint_probs(tiny[1], prompt, temperature).reshape(-1) * n
    counts = np.zeros(VOCAB**3)
    for ((a, b, c),) in outs:
        counts[(a * VOCAB + b) * VOCAB + c] += 1
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    wanted = np.append(expected[big], expected[~big].sum())
    assert big.sum() >= 10
    _, p_value = stats.chisquare(observed, wanted * observed.sum() / wanted.sum())
    assert p_value > 1e-3, p_value


def test_metrics(spec):
    """`LLM.get_metrics()` has vLLM's speculative-decoding counters, as the
    scheduler counts them."""
    counts = spec.engine.get_stats().spec_decoding
    metrics = {m.name: m for m in spec.get_metrics()}
    assert metrics["jaxengine:spec_decode_num_drafts"].value == counts.num_drafts > 0
    assert metrics["jaxengine:spec_decode_num_draft_tokens"].value == counts.num_draft_tokens
    accepted = metrics["jaxengine:spec_decode_num_accepted_tokens"].value
    assert accepted == counts.num_accepted_tokens > 0
    per_pos = metrics["jaxengine:spec_decode_num_accepted_tokens_per_pos"].values
    assert per_pos == list(counts.accepted_per_pos) and sum(per_pos) == accepted
    assert per_pos[0] >= per_pos[1] >= per_pos[2]
    assert metrics["jaxengine:generation_tokens"].value > 0


def test_eagle_drafts_are_the_heads_on_the_targets_features(tiny, prompts, tmp_path, monkeypatch):
    """A random EAGLE head (fc with a bias, the target's embedding shared): each draft
    is the argmax of the target's LM head on the head's feature, computed here with
    transformers from the target's last hidden states: the head over the request's
    tokens shifted by one beside those states, then once more per draft, fed its own
    previous feature."""
    torch.manual_seed(1)
    model = tiny[1]
    config = transformers.LlamaConfig(**{**model.config.to_dict(), "num_hidden_layers": 1})
    head = transformers.LlamaModel(config).eval()
    width = config.hidden_size
    fc = torch.nn.Linear(2 * width, width)
    with torch.no_grad():
        fc.weight.normal_(0, 0.1)
        fc.bias.normal_(0, 0.1)
    skip = ("norm.", "embed_tokens.", "layers.0.input_layernorm")
    tensors = {k: v for k, v in head.state_dict().items() if not k.startswith(skip)}
    _save_head(tmp_path / "head", config, {**tensors, "fc.weight": fc.weight, "fc.bias": fc.bias})
    seen = []
    propose = EagleProposer.propose

    def spy(self, inputs, features, ensure):
        drafts = propose(self, inputs, features, ensure)
        seen.extend(
            (list(x.token_ids), x.num_computed, d) for x, d in zip(inputs, drafts, strict=True) if d
        )
        return drafts

    monkeypatch.setattr(EagleProposer, "propose", spy)
    options = {"method": "eagle", "model": str(tmp_path / "head"), "num_speculative_tokens": 3}
    llm = LLM(tiny[0], speculative_config=options, **KWARGS)
    try:
        _run(llm, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    finally:
        llm.shutdown()
    assert len(seen) >= 20
    head.layers[0].input_layernorm = torch.nn.Identity()
    head.norm = torch.nn.Identity()
    for tokens, n, drafts in seen:
        with torch.no_grad():
            out = model(torch.tensor([tokens[:n]]), output_hidden_states=True)
            ids, feats = tokens[1 : n + 1], out.hidden_states[-1][0]
            for draft in drafts:
                x = torch.cat([model.model.embed_tokens(torch.tensor(ids)), feats], -1)
                feature = head(inputs_embeds=fc(x)[None]).last_hidden_state[0, -1]
                logits = model.lm_head(feature)
                assert logits[draft] >= logits.max() - 1e-4 * logits.abs().max()  # (ties)
                ids, feats = ids + [draft], torch.cat([feats, feature[None]])


def test_a_head_that_does_not_fit_is_refused(tiny, tmp_path):
    """A model folder that is no EAGLE head, and a head of another hidden size, are
    clear errors naming the problem."""
    options = {
        "method": "eagle",
        "model": str(Path(tiny[0]) / "draft"),
        "num_speculative_tokens": 2,
    }
    with pytest.raises(ValueError, match="no fc.weight: not a checkpoint in the EAGLE layout"):
        LLM(tiny[0], speculative_config=options, **KWARGS)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2)  # fmt: skip
    _save_head(tmp_path / "head", config, {"fc.weight": torch.zeros(32, 64)})
    options["model"] = str(tmp_path / "head")
    with pytest.raises(ValueError, match="hidden_size 32, the target 64"):
        LLM(tiny[0], speculative_config=options, **KWARGS)
