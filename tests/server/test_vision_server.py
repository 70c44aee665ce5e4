"""A vision-language model behind `jaxengine serve`, with the openai client.

The tiny random SmolVLM of tests/engine/test_vision_engine.py (whose offline engine
equals transformers), served with --limit-mm-per-prompt 2 and a local media folder.
Chat with ``image_url`` parts as data: URLs, file:// paths and http URLs (a local
HTTP server) gives transformers' greedy tokens; a corrupt image, one image too many,
a path outside the folder and a URL that fails are 400s naming the problem, and the
server keeps serving; the encoder cache's hits reach /metrics.
"""

from __future__ import annotations

import base64
import functools
import http.server
import io
import threading

import numpy as np
import openai
import pytest
import transformers
from PIL import Image

from tests.models.hf_reference import hf_greedy_images, reference_threads
from tests.server.conftest import API_KEY, start_server, stop_server

MAX_TOKENS = 6
FLAGS = [
    "--api-key", API_KEY,
    "--max-model-len", "128",
    "--max-num-seqs", "4",
    "--max-num-batched-tokens", "32",
    "--compile-token-buckets", "8", "32",
    "--limit-mm-per-prompt", '{"image": 2}',
]  # fmt: skip


def _image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


WIDE, SQUARE = _image(20, 80, 0), _image(50, 60, 1)


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _data_url(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(image)).decode()


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """(the allowed folder with square.png, an http server's base URL with wide.png)."""
    folder = tmp_path_factory.mktemp("media")
    (folder / "square.png").write_bytes(_png(SQUARE))
    web = tmp_path_factory.mktemp("web")
    (web / "wide.png").write_bytes(_png(WIDE))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(web))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield folder, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def vision_server(tiny_smolvlm, media, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server-vision") / "server.log"
    flags = [str(tiny_smolvlm[0]), *FLAGS, "--allowed-local-media-path", str(media[0])]
    running = start_server(log_path, flags)
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def client(vision_server):
    return vision_server.client(max_retries=0, timeout=120)


def _messages(urls: list[str], text: str = "What is in these?") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def _chat(client, urls: list[str], text: str = "What is in these?") -> list[int]:
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=_messages(urls, text),
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    return reply.choices[0].token_ids


@pytest.fixture(scope="module")
def reference(tiny_smolvlm):
    """transformers' greedy tokens for (images, text), the chat rendered by the
    model's own processor."""
    reference_threads()
    folder, model = tiny_smolvlm
    processor = transformers.AutoProcessor.from_pretrained(folder)

    def generate(images: list[Image.Image], text: str = "What is in these?") -> list[int]:
        parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        prompt = processor.apply_chat_template(
            [{"role": "user", "content": parts}], add_generation_prompt=True
        )
        kwargs = {"add_special_tokens": False}  # the template rendered them
        return hf_greedy_images(model, processor, prompt, images, MAX_TOKENS, **kwargs)[0]

    return generate


def test_data_urls_give_transformers_tokens(client, reference):
    assert _chat(client, [_data_url(WIDE), _data_url(SQUARE)]) == reference([WIDE, SQUARE])
    assert _chat(client, [_data_url(SQUARE)], "One?") == reference([SQUARE], "One?")


def test_file_and_http_urls_are_the_same_images(client, media, reference):
    folder, web = media
    urls = [f"file://{folder / 'square.png'}", f"{web}/wide.png"]
    assert _chat(client, urls) == reference([SQUARE, WIDE])


@pytest.mark.parametrize(
    "urls, needle",
    [
        (["data:image/png;base64," + base64.b64encode(b"not a png").decode()], "cannot decode"),
        ([_data_url(WIDE)] * 3, "At most 2 image(s)"),
        (["file:///etc/hostname"], "allowed-local-media-path"),
        (["http://127.0.0.1:9/none.png"], "cannot fetch the image"),
    ],
    ids=["corrupt", "too_many", "outside_folder", "unreachable"],
)
def test_bad_images_are_400s_and_the_server_keeps_serving(client, urls, needle, reference):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, urls)
    assert needle in str(info.value)
    assert _chat(client, [_data_url(SQUARE)], "One?") == reference([SQUARE], "One?")


def test_encoder_cache_hits_reach_metrics(client, vision_server):
    before = vision_server.metrics()
    _chat(client, [_data_url(WIDE)], "First question about it?")
    _chat(client, [_data_url(WIDE)], "A second, different question?")
    after = vision_server.metrics()
    assert after["vllm:mm_cache_queries_total"] - before["vllm:mm_cache_queries_total"] == 2
    assert after["vllm:mm_cache_hits_total"] - before["vllm:mm_cache_hits_total"] >= 1
