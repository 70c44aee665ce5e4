"""`jaxengine/multimodal/media.py`: image URLs to RGB images, and every way one is refused.

data: URLs (good, bad base64, bytes that are no image, a truncated PNG, a cap);
file:// inside and outside --allowed-local-media-path (``..``, a symlink, the flag
unset); http(s) against a local server in a thread (an image, a 404, too large with
and without Content-Length, a server slower than the timeout, a host or a redirect
outside --allowed-media-domains); the settings from the engine config and env.
"""

from __future__ import annotations

import base64
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from io import BytesIO

import pytest
from PIL import Image

from jaxengine.config import MultiModalConfig
from jaxengine.multimodal.media import MediaError, MediaSettings, load_image, media_settings


def png_bytes(mode: str = "RGB") -> bytes:
    """A 4x3 PNG whose pixel (x, y) is (10x, 20y, 7)."""
    image = Image.new("RGB", (4, 3))
    for x in range(4):
        for y in range(3):
            image.putpixel((x, y), (10 * x, 20 * y, 7))
    out = BytesIO()
    image.convert(mode).save(out, format="PNG")
    return out.getvalue()


PNG = png_bytes()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def assert_is_png(image: Image.Image) -> None:
    assert image.mode == "RGB" and image.size == (4, 3)
    assert image.getpixel((3, 2)) == (30, 40, 7)


# ---------------------------------------------------------------------- data:


def test_data_url_gives_the_rgb_image():
    assert_is_png(load_image(data_url(PNG), MediaSettings()))
    rgba = load_image(data_url(png_bytes("RGBA")), MediaSettings())
    assert rgba.mode == "RGB" and rgba.getpixel((1, 1)) == (10, 20, 7)


@pytest.mark.parametrize(
    "url, needle",
    [
        ("data:image/png;base64,@@not base64@@", "not valid base64"),
        (data_url(b"these bytes are no image"), "cannot decode the image"),
        (data_url(PNG[: len(PNG) // 2]), "cannot decode the image"),  # truncated
        (data_url(PNG, "text/plain"), "media type must be image/*"),
        ("data:image/png," + "x" * 8, "only base64 data URLs"),
        ("data:image/png;base64", "needs a comma"),
        ("ftp://example.com/a.png", "scheme 'ftp' is not supported"),
        ("", "non-empty string"),
    ],
)
def test_bad_data_urls_name_the_problem(url, needle):
    with pytest.raises(MediaError, match=needle):
        load_image(url, MediaSettings())


def test_data_url_over_the_cap_is_refused():
    with pytest.raises(MediaError, match=f"larger than {len(PNG) - 1} bytes"):
        load_image(data_url(PNG), MediaSettings(max_bytes=len(PNG) - 1))
    assert_is_png(load_image(data_url(PNG), MediaSettings(max_bytes=len(PNG))))


# ---------------------------------------------------------------------- file://


@pytest.fixture
def media(tmp_path):
    """(allowed dir with a.png and a symlink out, a PNG outside it)."""
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(PNG)
    outside = tmp_path / "secret.png"
    outside.write_bytes(PNG)
    (allowed / "link.png").symlink_to(outside)
    return allowed, outside


def test_file_inside_the_allowed_path_is_read(media):
    allowed, _ = media
    settings = MediaSettings(allowed_local_media_path=str(allowed))
    assert_is_png(load_image((allowed / "a.png").as_uri(), settings))
    with pytest.raises(MediaError, match="cannot read the image file"):
        load_image((allowed / "missing.png").as_uri(), settings)


def test_files_outside_the_allowed_path_are_refused(media):
    allowed, outside = media
    settings = MediaSettings(allowed_local_media_path=str(allowed))
    escapes = [
        outside.as_uri(),  # plainly outside
        f"file://{allowed}/../{outside.name}",  # `..` out of the directory
        (allowed / "link.png").as_uri(),  # a symlink inside pointing out
        allowed.as_uri(),  # the directory itself
    ]
    for url in escapes:
        with pytest.raises(MediaError, match="not inside --allowed-local-media-path"):
            load_image(url, settings)
    with pytest.raises(MediaError, match="not a host"):
        load_image(f"file://otherhost{allowed}/a.png", settings)


def test_file_urls_are_refused_without_the_flag(media):
    allowed, _ = media
    with pytest.raises(MediaError, match="--allowed-local-media-path DIR"):
        load_image((allowed / "a.png").as_uri(), MediaSettings())


def test_file_over_the_cap_is_refused(media):
    allowed, _ = media
    settings = MediaSettings(allowed_local_media_path=str(allowed), max_bytes=len(PNG) - 1)
    with pytest.raises(MediaError, match=f"larger than {len(PNG) - 1} bytes"):
        load_image((allowed / "a.png").as_uri(), settings)


# ---------------------------------------------------------------------- http(s)

BIG = PNG + b"\0" * 1000  # a valid PNG with trailing bytes, over a small cap


class Handler(BaseHTTPRequestHandler):
    """/a.png, /big (no Content-Length), /big-declared, /slow (1 s late), /moved
    (302 to localhost, the same server by another host name), anything else 404."""

    def do_GET(self):  # noqa: N802 - http.server's name
        port = self.server.server_address[1]
        if self.path == "/slow":
            time.sleep(1.0)
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{port}/a.png")
            self.end_headers()
            return
        body = {"/a.png": PNG, "/slow": PNG, "/big": BIG, "/big-declared": BIG}.get(self.path)
        if body is None:
            self.send_error(404, "Not Found")
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        if self.path != "/big":
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def base_url(monkeypatch):
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_http_image_is_fetched(base_url):
    assert_is_png(load_image(f"{base_url}/a.png", MediaSettings()))
    allowed = MediaSettings(allowed_media_domains=("127.0.0.1",))
    assert_is_png(load_image(f"{base_url}/a.png", allowed))


def test_http_error_status_is_named(base_url):
    with pytest.raises(MediaError, match="failed: HTTP 404 Not Found"):
        load_image(f"{base_url}/nothing.png", MediaSettings())


@pytest.mark.parametrize("path", ["/big", "/big-declared"])
def test_http_image_over_the_cap_is_refused(base_url, path):
    with pytest.raises(MediaError, match=f"larger than {len(PNG)} bytes"):
        load_image(base_url + path, MediaSettings(max_bytes=len(PNG)))
    assert load_image(base_url + path, MediaSettings(max_bytes=len(BIG))).size == (4, 3)


def test_slow_server_times_out(base_url):
    start = time.monotonic()
    with pytest.raises(MediaError, match=r"timed out after 0.2 s \(\$VLLM_IMAGE_FETCH_TIMEOUT\)"):
        load_image(f"{base_url}/slow", MediaSettings(fetch_timeout=0.2))
    assert time.monotonic() - start < 0.9


def test_hosts_outside_the_allowed_domains_are_refused(base_url):
    settings = MediaSettings(allowed_media_domains=("example.com",))
    with pytest.raises(MediaError, match="'127.0.0.1' is not allowed .*example.com"):
        load_image(f"{base_url}/a.png", settings)
    local = MediaSettings(allowed_media_domains=("127.0.0.1",))
    with pytest.raises(MediaError, match="'localhost' is not allowed"):
        load_image(f"{base_url}/moved", local)  # the redirect leaves the allowed hosts
    anywhere = MediaSettings()
    assert_is_png(load_image(f"{base_url}/moved", anywhere))


# ---------------------------------------------------------------------- settings


def test_settings_from_the_engine_config_and_env():
    config = MultiModalConfig(
        allowed_local_media_path="/srv/images", allowed_media_domains=["Example.COM"]
    )
    env = {"VLLM_IMAGE_FETCH_TIMEOUT": "2.5", "JAXENGINE_MAX_IMAGE_BYTES": "1000"}
    assert media_settings(config, env) == MediaSettings("/srv/images", ("example.com",), 2.5, 1000)
    assert media_settings(MultiModalConfig(), {}) == MediaSettings("", None, 5.0, 20 * 2**20)
