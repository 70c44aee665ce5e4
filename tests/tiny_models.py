"""Tiny random Llama configs for tests: one definition of the shapes they share."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import torch
import transformers

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
)


def tiny_llama_config(vocab_size: int, **overrides: Any) -> transformers.LlamaConfig:
    """A Llama config of hidden size 64, MLP 128, 2 layers, 4 query / 2 KV heads and
    256 positions, with ``overrides``."""
    fields = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return transformers.LlamaConfig(**{**fields, **overrides})


def tiny_cross_encoder(folder: Path, tokenizer_dir: Path, num_labels: int):
    """A random 2-layer `BertForSequenceClassification` (BERT's vocabulary) saved in
    ``folder`` with the tokenizer files of ``tokenizer_dir``; returns the model."""
    torch.manual_seed(num_labels)
    config = transformers.BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=128, num_labels=num_labels,
    )  # fmt: skip
    model = transformers.BertForSequenceClassification(config).eval()
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, folder / name)
    return model


def save_tiny_smollm2(folder: Path, tokenizer) -> transformers.PreTrainedModel:
    """A random 2-layer Llama with SmolLM2's vocabulary, tied embeddings and rope (6
    query / 3 KV heads: tensor parallelism over 3 devices splits it as it splits
    SmolLM2's 9/3), saved in ``folder`` with SmolLM2's tokenizer and chat template.
    Its step compiles in about a second where SmolLM2's 30 layers take eight. Seeded:
    every process that builds it gets the same weights."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=3,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>")


def vision_chat_template(image: str) -> str:
    """ChatML, as SmolLM2's, with list content: an image part renders as ``image``."""
    return (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
        f"{{{{ '{image}' }}}}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
        "{{ '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )


def save_tiny_smolvlm(folder: Path, tokenizer) -> transformers.PreTrainedModel:
    """A random SmolVLM (`Idefics3ForConditionalGeneration`): a 2-layer SigLIP tower of
    32-pixel tiles (4 x 4 patches, 4 tokens a tile after the pixel shuffle), a 2-layer
    Llama decoder, SmolLM2's tokenizer with the image tokens added, and an
    `Idefics3Processor` that splits an image of up to 64 pixels into at most 2 x 2
    crops plus the global tile; saved in ``folder``. Every weight is drawn at
    std 0.2 (DESIGN §4: at 0.02 different images often give the same tokens)."""
    tokenizer = copy.deepcopy(tokenizer)
    rows = [f"<row_{r}_col_{c}>" for r in range(1, 3) for c in range(1, 3)]
    tokenizer.add_special_tokens({"additional_special_tokens": [*IMAGE_TOKENS, *rows]})
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, image_size=32, patch_size=8)  # fmt: skip
    text = dict(tiny_llama_config(len(tokenizer), max_position_embeddings=512).to_dict())
    config = transformers.Idefics3Config(
        vision_config=vision,
        text_config=text,
        scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=False,
    )
    model = _redrawn(transformers.Idefics3ForConditionalGeneration, config)
    model.save_pretrained(folder)
    images = transformers.Idefics3ImageProcessorPil(
        size={"longest_edge": 64}, max_image_size={"longest_edge": 32}
    )
    processor = transformers.Idefics3Processor(
        image_processor=images,
        tokenizer=tokenizer,
        image_seq_len=4,
        chat_template=vision_chat_template("<image>"),
    )
    processor.save_pretrained(folder)
    return model


GEMMA3_IMAGE_TOKENS = {
    "boi_token": "<start_of_image>",
    "image_token": "<image_soft_token>",
    "eoi_token": "<end_of_image>",
}


def save_tiny_gemma3_vlm(folder: Path, tokenizer) -> transformers.PreTrainedModel:
    """A random Gemma 3 vision-language model (`Gemma3ForConditionalGeneration`): a
    2-layer SigLIP tower of 32-pixel images pooled to 4 tokens, a 2-layer Gemma 3
    decoder, SmolLM2's tokenizer with Gemma's image tokens (named in its
    ``extra_special_tokens``, as Gemma's tokenizer names them) and a `Gemma3Processor`;
    saved in ``folder``. Every weight is drawn at std 0.2."""
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": list(GEMMA3_IMAGE_TOKENS.values())})
    tokenizer.save_pretrained(folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["extra_special_tokens"] = GEMMA3_IMAGE_TOKENS
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in GEMMA3_IMAGE_TOKENS.items()}
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, image_size=32,
                  num_attention_heads=4, patch_size=8, model_type="siglip_vision_model",
                  vision_use_head=False)  # fmt: skip
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, head_dim=16,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512, sliding_window=512,
                query_pre_attn_scalar=16)  # fmt: skip
    config = transformers.Gemma3Config(
        vision_config=vision,
        text_config=text,
        mm_tokens_per_image=4,
        image_token_index=ids["image_token"],
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
    )
    model = _redrawn(transformers.Gemma3ForConditionalGeneration, config)
    model.save_pretrained(folder)
    processor = transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}),
        tokenizer=tokenizer,
        image_seq_length=4,
        chat_template=vision_chat_template("<start_of_image>"),
    )
    processor.save_pretrained(folder)
    return model


def _redrawn(model_class, config) -> transformers.PreTrainedModel:
    """``model_class(config)`` with every weight drawn at std 0.2 (seeded: DESIGN §4,
    at 0.02 different images often give the same tokens)."""
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model


QWEN2_5_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def save_tiny_qwen2_5_vl(folder: Path, tokenizer) -> transformers.PreTrainedModel:
    """A random Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): a 2-layer tower of
    8-pixel patches (2 x 2 merged into a token; 32-pixel windows, so an image of more
    than 2 x 2 tokens has several; block 1 attends fully), a 2-layer Qwen2 decoder with
    M-RoPE, SmolLM2's tokenizer with Qwen's vision tokens and a chat template that
    renders an image part as ``<|vision_start|><|image_pad|><|vision_end|>``, and the
    PIL image processor (images of 256 to 4096 pixels: 1 to 16 tokens); saved in
    ``folder``. transformers' processor cannot be saved without torchvision: the
    folder holds its parts, as `jaxengine.multimodal.qwen2_5_vl.load_processor`
    reads them. Every weight is drawn at std 0.2."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN2_5_VL_TOKENS)})
    tokenizer.chat_template = vision_chat_template("<|vision_start|><|image_pad|><|vision_end|>")
    tokenizer.save_pretrained(folder)
    ids = [tokenizer.convert_tokens_to_ids(t) for t in QWEN2_5_VL_TOKENS]
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                  patch_size=8, temporal_patch_size=2, spatial_merge_size=2, window_size=32,
                  fullatt_block_indexes=[1])  # fmt: skip
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512, rope_parameters=rope,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    config = transformers.Qwen2_5_VLConfig(
        vision_config=vision, text_config=text, vision_start_token_id=ids[0],
        vision_end_token_id=ids[1], image_token_id=ids[2], video_token_id=ids[3],
        tie_word_embeddings=False,
    )  # fmt: skip
    model = _redrawn(transformers.Qwen2_5_VLForConditionalGeneration, config)
    model.save_pretrained(folder)
    Qwen2VLImageProcessorPil(
        patch_size=8, temporal_patch_size=2, merge_size=2, min_pixels=256, max_pixels=4096
    ).save_pretrained(folder)
    return model
