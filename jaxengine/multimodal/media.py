"""Images named by URL (chat messages, the server's and `LLM.chat`'s): ``data:``,
``file://`` and ``http(s)://`` to PIL.

`load_image(url, settings)` returns an RGB `PIL.Image.Image`; every failure is a
`MediaError` (a ValueError, so the app answers 400) whose message names the problem.

- ``data:image/<type>;base64,<data>``: decoded in place.
- ``file:///abs/path``: read only when the path, with ``..`` and symlinks resolved,
  lies inside ``--allowed-local-media-path`` (unset, the default: refused, as vLLM).
- ``http://`` and ``https://``: fetched with urllib within ``$VLLM_IMAGE_FETCH_TIMEOUT``
  seconds (each socket wait, and the body as a whole between reads); with
  ``--allowed-media-domains`` only from those hosts, redirects included.

Every source is capped at ``$JAXENGINE_MAX_IMAGE_BYTES`` encoded bytes (at most one
byte more is read). The calls block: the chat handler runs them in threads.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import http.client
import os
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from io import BytesIO
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO
from urllib.parse import urlsplit

from PIL import Image

from jaxengine.version import __version__

if TYPE_CHECKING:
    from jaxengine.config.multimodal import MultiModalConfig

USER_AGENT = f"jaxengine/{__version__}"
_CHUNK = 64 * 1024


class MediaError(ValueError):
    """An image URL that cannot be loaded: the request's fault (400)."""


@dataclasses.dataclass(frozen=True)
class MediaSettings:
    """Where images may come from, and how long and large they may be."""

    allowed_local_media_path: str = ""
    """The directory file:// URLs may read below ("" refuses them)."""
    allowed_media_domains: tuple[str, ...] | None = None
    """The hosts http(s) URLs may name (lower case); None allows any."""
    fetch_timeout: float = 5.0
    """Seconds an http(s) fetch may take."""
    max_bytes: int = 20 * 2**20
    """The largest encoded image, in bytes."""


def media_settings(
    config: MultiModalConfig, environ: Mapping[str, str] = os.environ
) -> MediaSettings:
    """The settings of the engine's media flags and the environment. An empty
    ``--allowed-media-domains`` list allows any host, as in vLLM."""
    domains = config.allowed_media_domains
    return MediaSettings(
        allowed_local_media_path=config.allowed_local_media_path or "",
        allowed_media_domains=tuple(d.lower() for d in domains) if domains else None,
        fetch_timeout=image_fetch_timeout(environ),
        max_bytes=max_image_bytes(environ),
    )


def load_image(url: str, settings: MediaSettings) -> Image.Image:
    """The RGB image ``url`` names; raises `MediaError`."""
    if not isinstance(url, str) or not url:
        raise MediaError("an image URL must be a non-empty string")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = _data_url_bytes(url, settings.max_bytes)
    elif scheme == "file":
        data = _file_bytes(url, settings)
    elif scheme in ("http", "https"):
        data = _fetch(url, settings)
    else:
        raise MediaError(
            f"image URL scheme {scheme!r} is not supported (data:, file://, http://, https://)"
        )
    return decode_image(data)


def decode_image(data: bytes) -> Image.Image:
    """``data`` decoded whole (a truncated file fails here, not later) to RGB."""
    try:
        image = Image.open(BytesIO(data))
        image.load()
        return image.convert("RGB")
    except Exception as e:  # noqa: BLE001 - PIL raises many types for bad bytes
        raise MediaError(f"cannot decode the image: {e}") from None


def _too_large(what: str, cap: int) -> MediaError:
    return MediaError(
        f"the image {what} is larger than {cap} bytes (the cap, $JAXENGINE_MAX_IMAGE_BYTES)"
    )


def _shown(url: str) -> str:
    return url if len(url) <= 100 else url[:97] + "..."


# ---------------------------------------------------------------------- data: and file://


def _data_url_bytes(url: str, cap: int) -> bytes:
    header, comma, payload = url[len("data:") :].partition(",")
    if not comma:
        raise MediaError("a data URL needs a comma before its data: data:image/png;base64,...")
    media_type, *params = header.split(";")
    if not media_type.strip().lower().startswith("image/"):
        raise MediaError(f"a data URL's media type must be image/*, got {media_type!r}")
    if "base64" not in (p.strip().lower() for p in params):
        raise MediaError("only base64 data URLs are supported: data:image/...;base64,...")
    if len(payload) > (cap // 3 + 1) * 4:  # more base64 than cap bytes can need
        raise _too_large("in the data URL", cap)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"the data URL is not valid base64: {e}") from None
    if len(data) > cap:
        raise _too_large("in the data URL", cap)
    return data


def _file_bytes(url: str, settings: MediaSettings) -> bytes:
    if not settings.allowed_local_media_path:
        raise MediaError(
            "file:// image URLs are refused: start the server with "
            "--allowed-local-media-path DIR to allow images from DIR"
        )
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"a file:// URL names a path on this server, not a host: {_shown(url)}")
    root = Path(settings.allowed_local_media_path).resolve()
    path = Path(urllib.request.url2pathname(parts.path)).resolve()  # `..` and symlinks
    if root not in path.parents:
        raise MediaError(
            f"the file {parts.path!r} is not inside --allowed-local-media-path {str(root)!r}"
        )
    try:
        with open(path, "rb") as f:
            data = f.read(settings.max_bytes + 1)
    except OSError as e:
        raise MediaError(f"cannot read the image file {parts.path!r}: {e.strerror}") from None
    if len(data) > settings.max_bytes:
        raise _too_large(f"file {parts.path!r}", settings.max_bytes)
    return data


# ---------------------------------------------------------------------- http(s)


def _check_host(url: str, settings: MediaSettings) -> None:
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise MediaError(f"an image URL must be http(s)://host/...: {_shown(url)}")
    allowed = settings.allowed_media_domains
    if allowed is not None and parts.hostname not in allowed:
        raise MediaError(
            f"the image host {parts.hostname!r} is not allowed (--allowed-media-domains: "
            f"{', '.join(allowed)})"
        )


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an http(s) URL on an allowed host."""

    def __init__(self, settings: MediaSettings) -> None:
        self.settings = settings

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        _check_host(newurl, self.settings)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _fetch(url: str, settings: MediaSettings) -> bytes:
    _check_host(url, settings)
    timeout = settings.fetch_timeout
    opener = urllib.request.build_opener(_CheckedRedirects(settings))
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
    deadline = time.monotonic() + timeout
    shown = _shown(url)
    try:
        with opener.open(request, timeout=timeout) as response:
            length = response.headers.get("Content-Length")
            if length and length.isdigit() and int(length) > settings.max_bytes:
                raise _too_large(f"at {shown}", settings.max_bytes)
            return _read_capped(response, settings.max_bytes, deadline, shown)
    except urllib.error.HTTPError as e:
        raise MediaError(f"fetching the image {shown} failed: HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        if isinstance(e.reason, TimeoutError):
            raise _timed_out(shown, timeout) from None
        raise MediaError(f"cannot fetch the image {shown}: {e.reason}") from None
    except TimeoutError:
        raise _timed_out(shown, timeout) from None
    except (OSError, http.client.HTTPException) as e:
        raise MediaError(f"cannot fetch the image {shown}: {e!r}") from None


def _timed_out(shown: str, timeout: float) -> MediaError:
    return MediaError(
        f"fetching the image {shown} timed out after {timeout:g} s ($VLLM_IMAGE_FETCH_TIMEOUT)"
    )


def _read_capped(stream: BinaryIO, cap: int, deadline: float, shown: str) -> bytes:
    """At most ``cap`` + 1 bytes of ``stream``, whatever arrives per read (``read1``),
    until ``deadline``."""
    chunks, size = [], 0
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError
        chunk = stream.read1(min(_CHUNK, cap + 1 - size))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if size > cap:
            raise _too_large(f"at {shown}", cap)


def image_fetch_timeout(environ: Mapping[str, str] = os.environ) -> float:
    """Seconds to fetch one image URL (``$VLLM_IMAGE_FETCH_TIMEOUT``, 5 as in vLLM)."""
    return float(environ.get("VLLM_IMAGE_FETCH_TIMEOUT") or 5)


def max_image_bytes(environ: Mapping[str, str] = os.environ) -> int:
    """The largest image (encoded bytes) a request may bring (``$JAXENGINE_MAX_IMAGE_BYTES``,
    20 MiB)."""
    return int(environ.get("JAXENGINE_MAX_IMAGE_BYTES") or 20 * 2**20)
