"""Safetensors reading: dtypes (bfloat16 included), shards, and damaged checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from jaxengine.loader.errors import CheckpointError
from jaxengine.loader.safetensors_io import INDEX_FILE, iter_safetensors, safetensors_files


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=g, dtype=torch.bfloat16),
        "model.norm.weight": torch.randn(8, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(4, 8, generator=g).half(),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(8, generator=g, dtype=torch.float64),
        "counts": torch.arange(5, dtype=torch.int64),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 3),
    }


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.float().numpy().astype(ml_dtypes.bfloat16)
    return t.numpy()


def _check(got: dict[str, np.ndarray], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        want = _as_numpy(tensor)
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        np.testing.assert_array_equal(got[name], want, err_msg=name)


def test_single_file_all_dtypes(tmp_path: Path):
    tensors = _tensors()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    got = dict(iter_safetensors(tmp_path))
    _check(got, tensors)
    assert got["model.embed_tokens.weight"].dtype == ml_dtypes.bfloat16
    assert not got["model.norm.weight"].flags.writeable  # a view of the file, not a copy
    _check(dict(iter_safetensors(tmp_path / "model.safetensors")), tensors)


def _write_sharded(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[:3],
        "model-00002-of-00002.safetensors": names[3:],
    }
    weight_map = {}
    for shard, members in shards.items():
        save_file({n: tensors[n] for n in members}, folder / shard)
        weight_map.update({n: shard for n in members})
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_sharded_folder_uses_the_index(tmp_path: Path):
    tensors = _tensors(1)
    _write_sharded(tmp_path, tensors)
    save_file({"stray": torch.ones(1)}, tmp_path / "not-in-index.safetensors")
    assert [f.name for f in safetensors_files(tmp_path)] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    _check(dict(iter_safetensors(tmp_path)), tensors)


def test_missing_shard_is_named(tmp_path: Path):
    _write_sharded(tmp_path, _tensors())
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        next(iter_safetensors(tmp_path))


def test_truncated_and_corrupt_files_are_named(tmp_path: Path):
    save_file(_tensors(), tmp_path / "good.safetensors")
    data = (tmp_path / "good.safetensors").read_bytes()
    cases = {
        "tiny": data[:5],
        "header": data[:40],
        "data": data[:-7],
        "json": data[:8] + b"{" * (len(data) - 8),
    }
    for label, content in cases.items():
        folder = tmp_path / label
        folder.mkdir()
        (folder / f"{label}.safetensors").write_bytes(content)
        with pytest.raises(CheckpointError, match=f"{label}.safetensors"):
            list(iter_safetensors(folder))


def test_folder_without_checkpoint(tmp_path: Path):
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        list(iter_safetensors(tmp_path))
    with pytest.raises(CheckpointError, match="no such"):
        list(iter_safetensors(tmp_path / "nope"))


def test_transformers_checkpoint_round_trip(tmp_path: Path):
    """A tiny model saved by transformers (sharded) reads back as its state dict."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / INDEX_FILE).is_file()
    _check(dict(iter_safetensors(tmp_path)), model.state_dict())
