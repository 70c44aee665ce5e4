"""A tiny random Llama, random PEFT adapters for it, and one LoRA engine over them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from tiny_models import tiny_llama_config

from jaxengine import LLM, LoRARequest
from tests.lora_adapters import make_adapter

VOCAB = 256
ENGINE_KWARGS = dict(
    skip_tokenizer_init=True,
    max_model_len=128,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    compile_token_buckets=[8, 32],
    enable_compilation_cache=False,
    swap_space=0,
    enable_lora=True,
    max_loras=2,
    max_lora_rank=8,
)
PROMPTS = [
    [int(t) for t in np.random.RandomState(i).randint(0, VOCAB, 5 + 7 * i)] for i in range(4)
]
# name -> make_adapter options: full and partial targets, rsLoRA, ranks below the slots'
ADAPTERS = {
    "a1": dict(seed=1, r=8),
    "a2": dict(seed=2, r=4, use_rslora=True, targets=("q_proj", "v_proj", "down_proj")),
    "a3": dict(seed=3, r=8, alpha=32, targets=("k_proj", "o_proj", "gate_proj", "up_proj")),
    "a4": dict(seed=4, r=2),
}


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory):
    """(checkpoint folder, transformers model) of a 2-layer Llama, GQA 8/2."""
    config = tiny_llama_config(VOCAB, num_attention_heads=8)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    path = tmp_path_factory.mktemp("lora_base")
    model.save_pretrained(path)
    return str(path), model


@pytest.fixture(scope="session")
def adapters(tiny_base, tmp_path_factory):
    """name -> (`LoRARequest`, PEFT reference model) for every entry of `ADAPTERS`."""
    root = tmp_path_factory.mktemp("lora_adapters")
    out = {}
    for i, (name, options) in enumerate(ADAPTERS.items()):
        peft_model = make_adapter(tiny_base[1], root / name, **options)
        out[name] = (LoRARequest(name, i + 1, str(root / name)), peft_model)
    return out


@pytest.fixture(scope="module")
def lora_llm(tiny_base):
    """One engine with two adapter slots of rank 8, shared by a module's tests."""
    llm = LLM(model=tiny_base[0], **ENGINE_KWARGS)
    yield llm
    llm.shutdown()
