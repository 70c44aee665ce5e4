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


def _write_shards(folder: Path, count: int) -> dict[str, torch.Tensor]:
    """`count` unindexed shards, each holding `_tensors(i)` under shard-prefixed names."""
    everything = {}
    for i in range(count):
        shard = {f"s{i}.{name}": t for name, t in _tensors(i).items()}
        save_file(shard, folder / f"part-{i}.safetensors")
        everything.update(shard)
    return everything


@pytest.mark.parametrize("workers", [1, 2, 5])
def test_parallel_workers_yield_the_same_tensors_in_order(tmp_path: Path, workers: int):
    tensors = _write_shards(tmp_path, 4)
    mapped = list(iter_safetensors(tmp_path))
    read = list(iter_safetensors(tmp_path, max_workers=workers))
    assert [n for n, _ in read] == [n for n, _ in mapped]
    _check(dict(read), tensors)
    assert all(not a.flags.writeable for _, a in read)


def test_parallel_workers_hold_at_most_that_many_shards(tmp_path: Path, monkeypatch):
    from jaxengine.loader import safetensors_io

    _write_shards(tmp_path, 6)
    reads, consumed = [], []
    real = safetensors_io._read_shard

    def counting(file, entries):
        reads.append(file.name)
        return real(file, entries)

    monkeypatch.setattr(safetensors_io, "_read_shard", counting)
    per_shard = len(_tensors())
    for i, _ in enumerate(iter_safetensors(tmp_path, max_workers=2)):
        if i % per_shard == 0:  # the first tensor of a shard
            consumed.append(i // per_shard)
            # read so far: the shards yielded, plus at most 2 - 1 ahead of this one
            assert len(reads) <= len(consumed) + 1
    assert len(reads) == 6


def test_parallel_workers_report_a_truncated_shard(tmp_path: Path):
    from jaxengine.loader.safetensors_io import _read_shard, read_safetensors_header

    _write_shards(tmp_path, 1)
    path = tmp_path / "part-0.safetensors"
    entries = read_safetensors_header(path)[0]
    path.write_bytes(path.read_bytes()[:-7])  # shrinks after the header check
    with pytest.raises(CheckpointError, match="part-0.safetensors: truncated"):
        _read_shard(path, entries)


def test_closing_the_parallel_reader_early(tmp_path: Path):
    _write_shards(tmp_path, 5)
    iterator = iter_safetensors(tmp_path, max_workers=2)
    assert next(iterator)[0].startswith("s0.")
    iterator.close()  # cancels the reads not started; does not hang


def test_ignore_patterns_skip_weight_files(tmp_path: Path):
    tensors = _tensors()
    save_file(tensors, tmp_path / "model.safetensors")
    save_file({"other": torch.ones(2)}, tmp_path / "consolidated.safetensors")
    assert len(safetensors_files(tmp_path)) == 2
    files = safetensors_files(tmp_path, ["consolidated*"])
    assert [f.name for f in files] == ["model.safetensors"]
    _check(dict(iter_safetensors(tmp_path, ignore_patterns=["consolidated*"])), tensors)
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        safetensors_files(tmp_path, ["*.safetensors"])


def test_ignore_patterns_may_not_drop_an_indexed_shard(tmp_path: Path):
    _write_sharded(tmp_path, _tensors())
    assert len(safetensors_files(tmp_path, ["original/**/*"])) == 2
    with pytest.raises(CheckpointError, match="--ignore-patterns skips: model-00002"):
        safetensors_files(tmp_path, ["model-00002*"])


def _tiny_llama_folder(folder: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="20KB")


def test_load_model_with_parallel_workers_loads_the_same_params(tmp_path: Path):
    import jax

    from jaxengine.config import LoadConfig, ModelConfig
    from jaxengine.loader import load_model

    _tiny_llama_folder(tmp_path)
    assert len(safetensors_files(tmp_path)) > 2
    model_config = ModelConfig(model=str(tmp_path), dtype="float32")
    plain = load_model(model_config, LoadConfig()).params
    parallel = load_model(model_config, LoadConfig(), max_parallel_loading_workers=3).params
    flat_plain = jax.tree_util.tree_leaves_with_path(plain)
    flat_parallel = jax.tree_util.tree_leaves_with_path(parallel)
    assert [p for p, _ in flat_plain] == [p for p, _ in flat_parallel]
    for (path, a), (_, b) in zip(flat_plain, flat_parallel, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))


def test_load_model_refuses_a_gguf_quantization_of_safetensors(tmp_path: Path):
    from jaxengine.config import LoadConfig, ModelConfig
    from jaxengine.loader import load_model

    _tiny_llama_folder(tmp_path)
    with pytest.raises(CheckpointError, match="--quantization gguf needs a .gguf model"):
        load_model(ModelConfig(model=str(tmp_path), quantization="gguf"), LoadConfig())
