"""``jaxengine tpu-check`` of vision-language models: the image encoder compiled for TPU.

A folder holding only the ``config.json`` of a tiny Qwen3.5 (``Qwen3_5ForConditionalGeneration``:
a 2-block tower of 8-pixel patches merged 2 x 2, a hybrid decoder) or Gemma 4
(``Gemma4ForConditionalGeneration``: a 2-layer tower of 4-pixel patches pooled 2 x 2,
a causal decoder: the TPU attention kernel has no both-ways image tokens yet) goes
through the check as a text model's does:
the image processor comes from the family's defaults with the tower's patch sizes
(``--mm-processor-kwargs`` bounding the images, as ``serve`` reads them), the encoder's
parameters and rows are placed shapes, and the encoder call compiles for every unit
bucket through the recorder under the name ``encoder``; the report counts its
parameters, its rows and its programs' temporaries, and says it fits. On v6e-1, and
at TP 2 on v5e-4 (the encoder replicated over the tensor group). Skipped where
libtpu is absent.
"""

from __future__ import annotations

import os

import pytest
import transformers

pytest.importorskip("libtpu", reason="the TPU compiler comes with the tpu extra")

from jaxengine.engine_args import EngineArgs  # noqa: E402
from jaxengine.multimodal.processor import ImageProcessor  # noqa: E402
from jaxengine.runner.buckets import default_token_buckets  # noqa: E402
from jaxengine.runner.kv_sizing import ACTIVATION_RESERVE  # noqa: E402
from jaxengine.tpu_check.check import check_engine  # noqa: E402
from tests.models.gemma4_tiny import gemma4_tiny  # noqa: E402
from tests.models.tiny_configs import TINY_SIZES  # noqa: E402

ENGINE = dict(
    max_model_len=256,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    compile_token_buckets=[64],  # one step bucket: the encoder's are what is under test
)
QWEN_TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                 linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"],
                 max_position_embeddings=256, eos_token_id=0,
                 rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                      partial_rotary_factor=0.75, mrope_section=[2, 2, 2],
                                      mrope_interleaved=True))  # fmt: skip
QWEN_VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                   patch_size=8, temporal_patch_size=2, spatial_merge_size=2,
                   num_position_embeddings=16)  # fmt: skip
GEMMA_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16, patch_size=4,
                    pooling_kernel_size=2, position_embedding_size=32)  # fmt: skip


def _qwen3_5() -> transformers.PretrainedConfig:
    config = transformers.Qwen3_5Config(
        text_config=QWEN_TEXT, vision_config=QWEN_VISION, image_token_id=122,
        video_token_id=123, vision_start_token_id=120, vision_end_token_id=121,
    )  # fmt: skip
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    return config


def _gemma4() -> transformers.PretrainedConfig:
    text = gemma4_tiny(dict(TINY_SIZES, vocab_size=256))
    config = transformers.Gemma4Config(
        text_config=text, vision_config=GEMMA_VISION, audio_config=None, image_token_id=250,
        video_token_id=249, audio_token_id=251, boi_token_id=252, eoi_token_id=253,
    )  # fmt: skip
    config.architectures = ["Gemma4ForConditionalGeneration"]
    return config


FAMILIES = {
    # (config, --mm-processor-kwargs, the most units one image then takes)
    "qwen3.5": (_qwen3_5, {"max_pixels": 4096}, 16),  # 4096 px / (8 * 2)^2 px a token
    "gemma4": (_gemma4, {"max_soft_tokens": 70}, 70),
}


def _bare_folder(path, config: transformers.PretrainedConfig) -> str:
    config.save_pretrained(path)
    assert os.listdir(path) == ["config.json"]
    return str(path)


@pytest.mark.parametrize(
    ("family", "topology", "tp"),
    [("qwen3.5", "v6e-1", 1), ("gemma4", "v6e-1", 1), ("qwen3.5", "v5e-4", 2)],
)
def test_every_encoder_bucket_compiles_and_counts(tmp_path, family, topology, tp):
    make, kwargs, units = FAMILIES[family]
    folder = _bare_folder(tmp_path, make())
    args = EngineArgs(model=folder, tensor_parallel_size=tp, mm_processor_kwargs=kwargs, **ENGINE)
    report = check_engine(args, topology, progress=False)
    assert report.fits, report.lines()
    encoder = [p for p in report.programs if p.name == "encoder"]
    assert len(encoder) == len(default_token_buckets(units)), [p.label for p in report.programs]
    assert {"step", "sampler"} <= {p.name for p in report.programs}
    labels = [p["program"] for p in report.to_json()["programs"]]
    units_named = [f"image encoder ({b} units)" for b in default_token_buckets(units)]
    assert [label for label in labels if label.startswith("image encoder")] == units_named
    # the largest encoder bucket does the most work; every program's temporaries count
    assert encoder[-1].flops > encoder[0].flops > 0
    assert report.largest_transient[1] == max(p.transient_bytes for p in report.programs)
    # its parameters (replicated: whole on every chip) are the chip's too; its rows
    # (64: the token budget, at least one largest image) are counted in what it needs
    assert 0 < report.encoder_params_bytes < report.params_bytes
    assert report.image_rows_bytes >= max(64, units) * 64 * 2
    assert report.needed_bytes == (
        report.params_bytes + report.kv_bytes + report.image_rows_bytes
        + report.largest_transient[1]
    )  # fmt: skip
    assert "image encoder" in report.lines()[1]
    # the KV cache is sized around them: weights, encoder, rows and cache within the
    # chip's share at --gpu-memory-utilization (0.9, less the activations' reserve)
    held = report.params_bytes + report.kv_bytes + report.image_rows_bytes
    assert held <= (0.9 - ACTIVATION_RESERVE) * report.hbm_bytes


def test_bare_config_processor_sizes_the_encoder_and_takes_no_prompt():
    """From the family's defaults with the tower's patches: Qwen2-VL's PIL image
    processor at 8-pixel patches (its default 1,003,520 pixels: 3,920 tokens, or 16
    under ``max_pixels`` 4096), Gemma 4's at its 280 soft tokens."""
    qwen = ImageProcessor.from_config(_qwen3_5())
    assert qwen.processor.image_processor.patch_size == 8
    assert (qwen.max_units, qwen.embeds_per_unit) == (1003520 // 256, 1)
    assert ImageProcessor.from_config(_qwen3_5(), {"max_pixels": 4096}).max_units == 16
    gemma = ImageProcessor.from_config(_gemma4())
    assert gemma.processor.image_processor.pooling_kernel_size == 2
    assert gemma.max_units == 280 and not gemma.bidirectional
    with pytest.raises(ValueError, match="processes no prompts"):
        qwen.process("w1", [])
