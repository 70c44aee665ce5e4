"""MTP speculation (``{"method": "mtp"}``) on a tiny random DeepSeek-V3: the same tokens
as without it, its drafts those of the checkpoint's multi-token-prediction layer.

transformers builds no MTP layer, so the checkpoint is its DeepSeek-V3 of three layers
saved whole, whose config.json then says two layers and ``num_nextn_predict_layers``
1: layer 2's tensors are the MTP layer's decoder block (latent attention and MoE,
under the published names), and the test adds the layer's ``enorm``, ``hnorm``,
``eh_proj`` and ``shared_head`` (and the copies of the embedding and LM head that real
checkpoints carry there). The layer is set to mimic the target, so its drafts are
often accepted, not always: the target's layer 0 adds nothing (zero ``o_proj`` and
``down_proj``), the MTP block is a copy of layer 1, every embedding row has the RMS
that ``eh_proj``'s embedding half undoes after ``enorm``, its hidden-state half is
small and random, and ``shared_head.norm`` is the target's final norm (random
weights, so a missing norm would show). The MTP layer at position p then computes
what the target computes at p + 1, without the first token.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from jaxengine import LLM, SamplingParams
from jaxengine.config import SpeculativeConfig
from jaxengine.speculative.device.eagle import EagleProposer
from tests.models.deepseek_v3_tiny import deepseek_v3_tiny
from tests.models.family_engine import ENGINE_KWARGS, check_engine, default_prompts, reference
from tests.models.tiny_configs import TINY_SIZES
from tests.tiny_models import tiny_llama_config

VOCAB = 64
LAYERS = 2  # the target's; layer 2 of the saved model is the MTP layer's block
EMBED_RMS = 0.5
KWARGS = {**ENGINE_KWARGS, "max_model_len": 96, "compile_token_buckets": [8, 32]}


def _config(layers: int) -> transformers.DeepseekV3Config:
    small = dict(TINY_SIZES, vocab_size=VOCAB)
    return transformers.DeepseekV3Config(
        **deepseek_v3_tiny(small, num_hidden_layers=layers, first_k_dense_replace=1),
        initializer_range=0.2,
    )


def _mimic(model) -> dict[str, torch.Tensor]:
    """Sets ``model`` (three layers) as the module docstring says; returns the MTP
    layer's own tensors (checkpoint names)."""
    m, width = model.model, model.config.hidden_size
    with torch.no_grad():
        e = m.embed_tokens.weight
        e.mul_(EMBED_RMS / e.pow(2).mean(-1, keepdim=True).sqrt())
        m.layers[0].self_attn.o_proj.weight.zero_()
        m.layers[0].mlp.down_proj.weight.zero_()
        m.layers[LAYERS].load_state_dict(m.layers[1].state_dict())
        m.norm.weight.copy_(1 + 0.3 * torch.randn(width))
        fc = torch.cat([EMBED_RMS * torch.eye(width), 0.005 * torch.randn(width, width)], 1)
        own = {
            "enorm.weight": torch.ones(width),
            "hnorm.weight": 1 + 0.3 * torch.randn(width),
            "eh_proj.weight": fc,
            "shared_head.norm.weight": m.norm.weight.clone(),
            "shared_head.head.weight": model.lm_head.weight.clone(),
            "embed_tokens.weight": e.clone(),
        }
    return {f"model.layers.{LAYERS}.{k}": v for k, v in own.items()}


def _write(path: Path, tensors: dict, mtp_layers: int) -> str:
    path.mkdir()
    config = _config(LAYERS)
    config.num_nextn_predict_layers = mtp_layers
    config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """({"mtp": the checkpoint with its MTP layer, "none": the same without the layer's
    tensors, "zero": the same saying num_nextn_predict_layers 0}, the transformers
    model of three layers (the MTP block last), the MTP layer's own tensors)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(LAYERS + 1)).float().eval()
    own = _mimic(model)
    root = tmp_path_factory.mktemp("mtp")
    model.save_pretrained(root / "whole")
    saved = load_file(root / "whole" / "model.safetensors")
    target = {k: v for k, v in saved.items() if not k.startswith(f"model.layers.{LAYERS}.")}
    paths = {
        "mtp": _write(root / "mtp", {**saved, **own}, 1),
        "none": _write(root / "none", target, 1),
        "zero": _write(root / "zero", target, 0),
    }
    return paths, model, own


@pytest.fixture(scope="module")
def prompts():
    """Random prompts: one longer than a step's budget (chunked), the third a prefix
    of the first."""
    rs = np.random.RandomState(0)
    first = rs.randint(0, VOCAB, 40).tolist()
    return [first, rs.randint(0, VOCAB, 7).tolist(), first[:20], rs.randint(0, VOCAB, 15).tolist()]


@pytest.fixture(scope="module")
def ref(checkpoints):
    llm = LLM(checkpoints[0]["mtp"], **KWARGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module", params=[1, 2], ids=["k1", "k2"])
def spec(request, checkpoints):
    options = {"method": "mtp", "num_speculative_tokens": request.param}
    llm = LLM(checkpoints[0]["mtp"], speculative_config=options, disable_log_stats=False,
              **KWARGS)  # fmt: skip
    yield llm
    assert llm.engine.executor.compiles_after_warmup == 0
    llm.shutdown()


def _run(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def test_greedy_tokens_are_those_without_speculation(ref, spec, prompts):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    before = spec.engine.get_stats().spec_decoding.num_accepted_tokens
    assert _run(spec, prompts, params) == _run(ref, prompts, params)
    accepted = spec.engine.get_stats().spec_decoding.num_accepted_tokens - before
    assert accepted > 24  # the mimic's drafts were accepted, not just tried


def test_seeded_sampling_is_that_without_speculation(ref, spec, prompts):
    params = [
        SamplingParams(n=2, temperature=0.8, top_k=20, seed=s, max_tokens=16, logprobs=2,
                       ignore_eos=True)
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


def test_metrics(spec):
    """vLLM's speculative-decoding counters, as the scheduler counts them."""
    counts = spec.engine.get_stats().spec_decoding
    metrics = {m.name: m for m in spec.get_metrics()}
    assert metrics["jaxengine:spec_decode_num_drafts"].value == counts.num_drafts > 0
    assert metrics["jaxengine:spec_decode_num_draft_tokens"].value == counts.num_draft_tokens
    accepted = metrics["jaxengine:spec_decode_num_accepted_tokens"].value
    assert accepted == counts.num_accepted_tokens > 0
    per_pos = metrics["jaxengine:spec_decode_num_accepted_tokens_per_pos"].values
    assert per_pos == list(counts.accepted_per_pos) and sum(per_pos) == accepted
    assert len(per_pos) == len(counts.accepted_per_pos) >= 1 and per_pos[0] > 0


def test_preemption_prefix_cache_and_parallel_layouts(checkpoints):
    """The family harness (`family_engine.check_engine`: chunked prefill, preemption,
    prefix-cache hits, no compilation after warm-up) with MTP proposals (k 2), under
    tensor parallelism 2 with expert parallelism: transformers' greedy tokens and
    logprobs, drafts accepted."""
    path, prompts = checkpoints[0]["mtp"], default_prompts(VOCAB)
    options = {"method": "mtp", "num_speculative_tokens": 2}
    stats = check_engine(path, reference(path, prompts, 12), prompts,
                         speculative_config=options, tensor_parallel_size=2,
                         enable_expert_parallel=True)  # fmt: skip
    assert stats.spec_decoding.num_accepted_tokens > 10


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _mtp_reference(model, own: dict):
    """``(target, step)``: the target in transformers (``model``'s first two layers),
    and the MTP layer, ``step(ids[n], feats[n, H]) -> (features[n, H], logits of the
    last)``: ``eh_proj([enorm(embed(ids)); hnorm(feats)])`` through the block (layer 2
    of ``model``, as a one-layer DeepSeek-V3 model without a final norm), then
    ``shared_head.norm`` and the LM head."""
    target = transformers.DeepseekV3ForCausalLM(_config(LAYERS)).float().eval()
    target.load_state_dict(model.state_dict(), strict=False)  # (without layer 2)
    config = _config(1)
    config.first_k_dense_replace = 0  # the block is a MoE layer
    block = transformers.DeepseekV3Model(config).float().eval()
    block.layers[0].load_state_dict(model.model.layers[LAYERS].state_dict())
    block.norm = torch.nn.Identity()
    weight = {k.rsplit(".", 2)[-2]: v for k, v in own.items() if k.endswith("norm.weight")}
    eps, prefix = config.rms_norm_eps, f"model.layers.{LAYERS}."

    def step(ids: list[int], feats: torch.Tensor):
        e = _rms_norm(target.model.embed_tokens(torch.tensor(ids)), weight["enorm"], eps)
        x = torch.cat([e, _rms_norm(feats, weight["hnorm"], eps)], -1)
        out = block(inputs_embeds=(x @ own[prefix + "eh_proj.weight"].T)[None])
        features = out.last_hidden_state[0]
        return features, target.lm_head(_rms_norm(features[-1], weight["norm"], eps))

    return target, step


def test_drafts_are_the_mtp_layers_on_the_targets_features(checkpoints, spec, prompts,
                                                           monkeypatch):  # fmt: skip
    """Each draft is the argmax of the target's LM head on the MTP layer's normed
    feature, computed here with transformers from the target's last hidden states:
    the layer over the request's tokens shifted by one beside those states, then (k 2)
    once more, fed the draft and its own previous feature."""
    seen = []
    propose = EagleProposer.propose

    def spy(self, inputs, features, ensure):
        drafts = propose(self, inputs, features, ensure)
        seen.extend(
            (list(x.token_ids), x.num_computed, d) for x, d in zip(inputs, drafts, strict=True) if d
        )
        return drafts

    monkeypatch.setattr(EagleProposer, "propose", spy)
    _run(spec, prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(seen) >= 12
    target, step = _mtp_reference(checkpoints[1], checkpoints[2])
    for tokens, n, drafts in seen[::3]:
        with torch.no_grad():
            out = target(torch.tensor([tokens[:n]]), output_hidden_states=True)
            ids, feats = tokens[1 : n + 1], out.hidden_states[-1][0]  # (after the final norm)
            for draft in drafts:
                features, logits = step(ids, feats)
                assert logits[draft] >= logits.max() - 1e-4 * logits.abs().max()  # (ties)
                ids, feats = ids + [draft], torch.cat([feats, features[-1:]])


def test_a_model_without_an_mtp_layer_is_refused(checkpoints, tmp_path):
    """A checkpoint without the layer's tensors, one whose config has no MTP layer,
    and a family without MTP layers: clear errors naming what is missing."""
    paths, options = checkpoints[0], {"method": "mtp", "num_speculative_tokens": 1}
    with pytest.raises(ValueError, match=r"model\.layers\.2\.\* \(num_nextn_predict_layers\), "
                       "which the checkpoint does not have"):  # fmt: skip
        LLM(paths["none"], speculative_config=options, **KWARGS)
    with pytest.raises(ValueError, match=r"model\.layers\.2\.\*, and .* has none "
                       r"\(config\.json's num_nextn_predict_layers is 0"):  # fmt: skip
        LLM(paths["zero"], speculative_config=options, **KWARGS)
    transformers.AutoModelForCausalLM.from_config(tiny_llama_config(VOCAB)).save_pretrained(
        tmp_path
    )
    with pytest.raises(ValueError, match="LlamaForCausalLM has none \\(families with one: "
                       "DeepseekV3ForCausalLM"):  # fmt: skip
        LLM(str(tmp_path), speculative_config=options, **KWARGS)


def test_config_names_and_refusals():
    """vLLM's older name of "mtp", "deepseek_mtp", is "mtp"; "mtp" runs (it is not
    refused as not supported yet) and takes no separate draft model."""
    from jaxengine.engine_args import EngineArgs

    old = SpeculativeConfig({"method": "deepseek_mtp", "num_speculative_tokens": 1})
    assert old.method == "mtp"
    options = {"method": "mtp", "num_speculative_tokens": 2}
    EngineArgs(speculative_config=options).create_engine_config()
    with pytest.raises(ValueError, match=r"own multi-token-prediction layer: drop \['model'\]"):
        SpeculativeConfig({**options, "model": "/m/mtp"})
