"""Resolving model names: local folders and files, the hub cache, an unreachable hub."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import huggingface_hub
import huggingface_hub.constants
import pytest

from jaxengine.loader import sources
from jaxengine.loader.errors import CheckpointError, HubUnreachableError, ModelNotFoundError
from jaxengine.loader.sources import resolve_model


def _hf_folder(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "model.safetensors").write_bytes(b"")
    return folder


@pytest.fixture
def no_hub(monkeypatch, tmp_path):
    """An empty hub cache and a hub endpoint that refuses connections."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


def test_local_hf_folder(tmp_path):
    folder = _hf_folder(tmp_path / "m")
    (folder / "extra.gguf").write_bytes(b"")  # safetensors win over a stray gguf
    src = resolve_model(str(folder))
    assert (src.path, src.gguf_file, src.kind, src.name) == (folder, None, "hf_dir", str(folder))
    assert not src.is_gguf


def test_gguf_file_and_folder(tmp_path):
    gguf = tmp_path / "g" / "model.Q4_0.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"")
    for name in (gguf, gguf.parent):
        src = resolve_model(name)
        assert (src.path, src.gguf_file, src.kind) == (gguf.parent, gguf, "gguf")
    (gguf.parent / "model.Q8_0.gguf").write_bytes(b"")
    with pytest.raises(CheckpointError, match="model.Q4_0.gguf, model.Q8_0.gguf"):
        resolve_model(gguf.parent)


def test_local_paths_that_are_not_models(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        resolve_model(tmp_path / "empty")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(CheckpointError, match=r"must be \.gguf"):
        resolve_model(tmp_path / "notes.txt")


@pytest.mark.parametrize("name", ["./nope", "/no/such/dir", "model.gguf", "a/b/c", "bad name!"])
def test_missing_paths_fail_without_the_hub(name, monkeypatch):
    monkeypatch.setattr(sources, "_hub_source", lambda *a: pytest.fail("hub consulted"))
    with pytest.raises(ModelNotFoundError, match="SmolLM2-135M-Instruct"):
        resolve_model(name)


def test_unreachable_hub_fails_fast_with_advice(no_hub):
    start = time.perf_counter()
    with pytest.raises(HubUnreachableError, match="unreachable.*local folder.*demo model"):
        resolve_model("someorg/somemodel")
    assert time.perf_counter() - start < 10


def test_silent_hub_times_out(no_hub, monkeypatch):
    """A host that accepts connections but never answers (a black hole behind a proxy)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)  # the kernel completes handshakes; nobody ever replies
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        start = time.perf_counter()
        assert not sources.hub_reachable(timeout=1.0)
        assert time.perf_counter() - start < 3


def test_offline_mode_and_disabled_downloads(no_hub, monkeypatch):
    with pytest.raises(HubUnreachableError, match="downloads are disabled"):
        resolve_model("someorg/somemodel", allow_download=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(sources, "hub_reachable", lambda: pytest.fail("probe while offline"))
    with pytest.raises(HubUnreachableError, match="HF_HUB_OFFLINE"):
        resolve_model("someorg/somemodel")


def test_hub_cache_is_used_offline(no_hub, tmp_path):
    repo = tmp_path / "dl" / "models--someorg--cached"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = _hf_folder(repo / "snapshots" / commit)
    src = resolve_model("someorg/cached", download_dir=tmp_path / "dl")
    assert (src.path, src.kind, src.gguf_file) == (snapshot, "hub", None)


def test_hub_id_of_a_demo_falls_back_to_the_demo(no_hub, smollm2_gguf, caplog):
    src = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert (src.kind, src.gguf_file) == ("demo", smollm2_gguf)
    assert "using the demo model SmolLM2-135M-Instruct" in caplog.text


def test_demo_names_resolve_to_the_cached_file(smollm2_gguf):
    for name in ("SmolLM2-135M-Instruct", "smollm2"):
        src = resolve_model(name)
        assert (src.kind, src.gguf_file, src.path) == ("demo", smollm2_gguf, smollm2_gguf.parent)


def test_is_ignored_matches_like_the_hub_client():
    from huggingface_hub.utils import filter_repo_objects

    from jaxengine.loader.sources import is_ignored

    paths = [
        "model.safetensors", "original/consolidated.00.pth", "original/sub/params.json",
        "model-Q8_0.gguf", "sub/model.safetensors", "README.md",
    ]  # fmt: skip
    for patterns in (["original/**/*"], ["original/"], ["*Q8*", "*.md"], ["*.safetensors"], []):
        kept = list(filter_repo_objects(paths, ignore_patterns=patterns))
        assert [p for p in paths if not is_ignored(p, patterns)] == kept, patterns
    assert is_ignored("original/sub/params.json", ["original/**/*"])
    assert is_ignored("original/x.bin", ["original/"])  # a folder: everything in it


def test_ignore_patterns_pick_among_local_files(tmp_path):
    folder = tmp_path / "g"
    folder.mkdir()
    for name in ("model.Q4_0.gguf", "model.Q8_0.gguf"):
        (folder / name).write_bytes(b"")
    src = resolve_model(folder, ignore_patterns=["*Q8_0*"])
    assert src.gguf_file == folder / "model.Q4_0.gguf"
    hf = _hf_folder(tmp_path / "m")
    (hf / "extra.gguf").write_bytes(b"")
    src = resolve_model(hf, ignore_patterns=["*.safetensors"])  # then the gguf is the model
    assert src.gguf_file == hf / "extra.gguf"


def test_ignore_patterns_reach_the_hub_download(tmp_path, monkeypatch):
    calls = []

    def snapshot_download(repo_id, **kwargs):
        calls.append(kwargs)
        return str(_hf_folder(tmp_path / "snap"))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    src = resolve_model("org/model", ignore_patterns=["original/**/*", "*.pth"])
    assert src.kind == "hub"
    assert calls[0]["ignore_patterns"] == ["original/**/*", "*.pth"]


def test_minilm_demo_resolves_to_its_folder(minilm_dir):
    for name in ("all-MiniLM-L6-v2", "minilm"):
        src = resolve_model(name)
        assert (src.kind, src.gguf_file, src.path) == ("demo", None, minilm_dir)
    assert (minilm_dir / "config.json").is_file() and (minilm_dir / "tokenizer.json").is_file()


def test_hub_id_of_the_folder_demo_falls_back_to_it(no_hub, minilm_dir, caplog):
    src = resolve_model("sentence-transformers/all-MiniLM-L6-v2")
    assert (src.kind, src.gguf_file, src.path) == ("demo", None, minilm_dir)
    assert "using the demo model all-MiniLM-L6-v2 (a copy from PyPI)" in caplog.text
