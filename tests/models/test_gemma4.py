"""Gemma 4 beyond the golden logits (`test_golden_tiny.py`) and the engine check
(`test_new_families_engine.py`): the text decoder of a checkpoint with vision and
audio towers, what is refused and how, and the Pallas kernels inside the model (its
per-layer head widths padded to the cache's)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from jaxengine.config import LoadConfig, ModelConfig
from jaxengine.loader import load_model
from jaxengine.models import get_model
from jaxengine.runner.attention_backend import kernels
from tests.models.family_engine import ENGINE_KWARGS, default_prompts, reference, save_tiny
from tests.models.gemma4_tiny import gemma4_moe_tiny, gemma4_tiny, randomize_scales
from tests.models.test_golden_tiny import check_family
from tests.models.tiny_configs import TINY_SIZES

VOCAB = 256
TINY = dict(TINY_SIZES, vocab_size=VOCAB)
REFUSED_MEDIA = "Gemma4ForConditionalGeneration: image, video and audio inputs are not supported"


def multimodal_config() -> transformers.Gemma4Config:
    """`gemma4_tiny`'s decoder under a one-layer audio tower and no vision tower (the
    media tokens at the vocabulary's top): served as its text decoder only. Images on
    a checkpoint with a vision tower: `test_vision_gemma4.py`."""
    text = transformers.Gemma4TextConfig(**gemma4_tiny(TINY))
    audio = transformers.Gemma4AudioConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        subsampling_conv_channels=[8, 4], output_proj_dims=32,
    )  # fmt: skip
    ids = dict(video_token_id=249, image_token_id=250, audio_token_id=251, boi_token_id=252)
    ids.update(eoi_token_id=253, boa_token_id=254, eoa_token_index=255)
    return transformers.Gemma4Config(
        text_config=text.to_dict(),
        vision_config=None,
        audio_config=audio.to_dict(),
        **ids,
    )


@pytest.fixture(scope="module")
def multimodal_checkpoint(tmp_path_factory) -> str:
    """A random ``Gemma4ForConditionalGeneration`` (norms and scales off one)."""
    torch.manual_seed(0)
    config = multimodal_config()
    config.text_config.initializer_range = 0.2
    model = transformers.Gemma4ForConditionalGeneration(config).float().eval()
    randomize_scales(model)
    path = tmp_path_factory.mktemp("gemma4_mm")
    model.save_pretrained(path)
    return str(path)


def test_conditional_generation_serves_its_text_decoder(multimodal_checkpoint):
    """The towers' tensors are skipped; text prompts give transformers' greedy tokens
    and top-5 logprobs; a prompt with an image or audio gets a ValueError naming the
    architecture and what it does not take yet."""
    from jaxengine import LLM, SamplingParams

    prompts = default_prompts(VOCAB - 8)[:2]  # below the media tokens
    ref = reference(multimodal_checkpoint, prompts, 4)
    llm = LLM(multimodal_checkpoint, **{**ENGINE_KWARGS, "num_gpu_blocks_override": 32})
    try:
        params = SamplingParams(temperature=0, logprobs=5, max_tokens=4, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for out, tokens, top in zip(outputs, ref.tokens, ref.top, strict=True):
            assert list(out.outputs[0].token_ids) == tokens
            for got, want in zip(out.outputs[0].logprobs, top, strict=True):
                assert max(abs(got[t].logprob - lp) for t, lp in want.items()) < 1e-4
        image = Image.new("RGB", (32, 32))
        audio = (np.zeros(1600, np.float32), 16000)
        for data in ({"image": image}, {"audio": audio}):
            with pytest.raises(ValueError, match=REFUSED_MEDIA) as error:
                llm.generate({"prompt": "hi", "multi_modal_data": data}, params, use_tqdm=False)
            assert str(sorted(data)) in str(error.value)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention='all'"),
        ({"num_kv_shared_layers": 5}, "num_kv_shared_layers=5"),
    ],
    ids=["bidirectional_all", "every_layer_shares_kv"],
)
def test_configs_it_cannot_serve_are_refused(change, field):
    """A clear ValueError naming the setting (not the torch fallback's
    `UnsupportedArchitectureError`)."""
    config = transformers.Gemma4TextConfig(**{**gemma4_tiny(TINY), **change})
    with pytest.raises(ValueError, match="not supported") as error:
        get_model(config, jnp.float32)
    assert field in str(error.value)
    assert type(error.value) is ValueError


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """The dense and MoE tiny checkpoints, saved once."""
    return {
        "dense": save_tiny(
            transformers.Gemma4TextConfig(**gemma4_tiny(TINY)), tmp_path_factory.mktemp("dense")
        ),
        "moe": save_tiny(
            transformers.Gemma4TextConfig(**gemma4_moe_tiny(TINY)), tmp_path_factory.mktemp("moe")
        ),
    }


@pytest.mark.parametrize(
    ("which", "model", "load", "message"),
    [
        ("dense", {"convert": "classify"}, {}, "sequence classifier"),
        ("moe", {"quantization": "int8"}, {}, "quantized Gemma 4 experts"),
        ("dense", {}, {"kv_cache_scales": True}, "fp8 KV cache"),
    ],
    ids=["classifier", "quantized_experts", "fp8_kv_cache"],
)
def test_load_refuses_what_the_layers_lack(checkpoints, which, model, load, message):
    """What the layers do not implement fails at load, naming it."""
    config = ModelConfig(model=checkpoints[which], dtype="float32", **model)
    with pytest.raises(NotImplementedError, match=message):
        load_model(config, LoadConfig(load_format="dummy"), **load)


def test_pipeline_parallel_refuses_per_layer_inputs(checkpoints):
    """The per-layer input tables sit with the last pipeline stage: refused, named."""
    from jaxengine import LLM

    kwargs = {**ENGINE_KWARGS, "num_gpu_blocks_override": 32, "pipeline_parallel_size": 2}
    with pytest.raises(NotImplementedError, match="per-layer inputs .* --pipeline-parallel-size"):
        LLM(checkpoints["dense"], load_format="dummy", **kwargs)


def test_pallas_kernels_inside_the_model(tmp_path):
    """`test_golden_tiny`'s check with the TPU Pallas kernels (interpret mode; the GPU
    ones take the same arguments): sliding heads of 16 zero-padded to the full layers'
    32, shared KV, per-layer inputs."""
    attention, update = kernels("tpu")
    kwargs = {
        "attention_fn": functools.partial(attention, interpret=True),
        "update_fn": functools.partial(update, interpret=True),
    }
    check_family("gemma4", tmp_path, attention_kwargs=kwargs)


@pytest.mark.parametrize(("partial", "factor"), [(0.25, 1.0), (0.5, 8.0)])
def test_proportional_rope_matches_transformers(partial, factor):
    """The full layers' "proportional" rope (`layers.rope`): the whole head of 64
    rotates, the first ``partial`` of its frequencies nonzero, all over ``factor``."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jaxengine.models.layers.config import rope_from_hf
    from jaxengine.models.layers.rope import inv_freq_and_scale

    full = {"rope_type": "proportional", "partial_rotary_factor": partial}
    full.update(rope_theta=1e6, factor=factor)
    params = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    config = transformers.Gemma4TextConfig(
        **{**gemma4_tiny(TINY), "global_head_dim": 64},
        rope_parameters={**params, "full_attention": full},
    )
    kind = "full_attention"
    want, want_scale = ROPE_INIT_FUNCTIONS["proportional"](config, "cpu", layer_type=kind)
    got, scale = inv_freq_and_scale(rope_from_hf(config, kind), 64)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
    assert scale == want_scale and np.count_nonzero(got) == int(partial * 32)
