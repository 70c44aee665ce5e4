"""Hugging Face configs: overrides, generation defaults, and the GGUF sidecar cache."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from jaxengine.loader.gguf_sidecar import gguf_sidecar, sidecar_folder
from jaxengine.loader.hf_config import apply_overrides, load_generation_config, load_hf_config


@pytest.fixture
def llama_folder(tmp_path: Path) -> Path:
    from transformers import LlamaConfig

    rope = {"rope_type": "default", "rope_theta": 1e4}
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        eos_token_id=[2, 7], bos_token_id=1, rope_parameters=rope,
    )  # fmt: skip
    config.save_pretrained(tmp_path)
    return tmp_path


def test_config_with_nested_overrides(llama_folder):
    config = load_hf_config(
        llama_folder,
        hf_overrides={"num_hidden_layers": 3, "rope_parameters": {"rope_theta": 5.0}},
    )
    assert type(config).__name__ == "LlamaConfig" and config.num_hidden_layers == 3
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 5.0}
    bumped = load_hf_config(llama_folder, hf_overrides=lambda c: setattr(c, "vocab_size", 8) or c)
    assert bumped.vocab_size == 8


def test_overrides_reach_sub_configs():
    from transformers import Gemma3Config

    config = Gemma3Config()
    apply_overrides(config, {"text_config": {"sliding_window": 7}, "image_token_index": 3})
    assert config.text_config.sliding_window == 7 and config.image_token_index == 3


def test_generation_config_from_folder(llama_folder):
    assert load_generation_config(llama_folder) == {"eos_token_id": [2, 7], "bos_token_id": 1}
    (llama_folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 2, "temperature": 0.6, "top_p": 0.9, "do_sample": True})
    )
    assert load_generation_config(llama_folder) == {
        "eos_token_id": 2,
        "temperature": 0.6,
        "top_p": 0.9,
    }


def test_generation_config_from_gguf(tmp_path):
    path = tmp_path / "g.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_eos_token_id(2)
    writer.add_bos_token_id(1)
    writer.add_uint32("tokenizer.ggml.eot_token_id", 9)
    writer.add_float32("general.sampling.temp", 0.5)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert load_generation_config(path) == {
        "eos_token_id": [2, 9],
        "bos_token_id": 1,
        "temperature": 0.5,
    }


def test_sidecar_builds_once_and_rebuilds_when_stale(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXENGINE_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"v1")
    builds = []

    def cached(value):
        def build():
            builds.append(value)
            return value

        return gguf_sidecar(
            model,
            "thing",
            build=build,
            save=lambda obj, folder: (folder / "v.txt").write_text(obj),
            load=lambda folder: (folder / "v.txt").read_text(),
        )

    assert cached("a") == "a" and cached("b") == "a" and builds == ["a"]
    os.utime(model, ns=(1, 1))  # a changed file gets a fresh entry
    assert cached("c") == "c" and builds == ["a", "c"]
    monkeypatch.setenv("JAXENGINE_GGUF_SIDECAR", "0")
    assert cached("d") == "d" and builds == ["a", "c", "d"]


def test_unreadable_sidecar_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXENGINE_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"v1")
    kwargs = {"save": lambda obj, folder: None}
    gguf_sidecar(model, "cfg", build=lambda: 1, load=lambda folder: 0, **kwargs)

    def broken(folder):
        raise ValueError("garbage")

    assert gguf_sidecar(model, "cfg", build=lambda: 2, load=broken, **kwargs) == 2


@pytest.mark.slow
def test_gguf_config_builds_no_tokenizer(smollm2_gguf, tmp_path, monkeypatch):
    """Reading a GGUF model's config fills the config's sidecar entry only."""
    import transformers

    monkeypatch.setenv("JAXENGINE_CACHE", str(tmp_path))

    def no_tokenizer(*args, **kwargs):
        raise AssertionError("reading a config built a tokenizer")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_tokenizer)
    config = load_hf_config(smollm2_gguf)
    assert config.model_type == "llama"
    assert sidecar_folder(smollm2_gguf, "config").is_dir()
    assert not sidecar_folder(smollm2_gguf, "tokenizer").exists()
    again = load_hf_config(smollm2_gguf)  # read back from the sidecar
    assert again.num_hidden_layers == config.num_hidden_layers == 30
