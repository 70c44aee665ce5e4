"""Chat messages with ``image_url`` parts, through the real app over a fake engine.

A request with images reaches the engine as the rendered text (an ``<image>`` where
the template placed each ``{"type": "image"}`` part), the images in message order and
the request's ``mm_processor_kwargs``; a request without images is the token ids as
before. 400s: a template that takes content as one string, a failed image load, what
the engine refuses (a text-only model), what images cannot run with, and /tokenize.
The media settings come from the engine's ``multimodal_config``.
"""

from __future__ import annotations

import base64
from io import BytesIO
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from jaxengine.config import MultiModalConfig
from jaxengine.config.arg_utils import FlexibleArgumentParser
from jaxengine.inputs import PreparedPrompt
from jaxengine.outputs import CompletionOutput, RequestOutput
from server.api_server.app import build_app
from server.api_server.args import add_server_args
from server.chat_rendering.images import NOT_HERE, NOT_MULTIMODAL
from server.chat_rendering.messages import NO_IMAGE_TEMPLATE, normalize_message
from server.errors import APIError

VISION = (
    "{% for m in messages %}<{{ m['role'] }}>"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
"""A template over content parts (auto format: "openai") that marks each image."""
TEXT_ONLY = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
"""A template that takes each message's content as one string."""


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A transformers tokenizer (one token per printable character, BOS ``<s>``) whose
    chat template is `VISION`: real template rendering, no download."""
    chars = [chr(i) for i in range(32, 127)]
    vocab = {t: i for i, t in enumerate(["[UNK]", "<s>", *chars])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", unk_token="[UNK]"
    )
    tokenizer.chat_template = VISION
    return tokenizer


TOKENIZER = char_tokenizer()


class FakeEngine:
    """What the app reads of an engine; ``prepare`` records every prompt and, like a
    vision model's, takes text with images (``images=False``: refuses them, as a
    text-only model does). Every request generates "ok"."""

    def __init__(self, images: bool = True, media_path: str = "", refuse: str = "") -> None:
        self.max_model_len, self.vocab_size = 4096, len(TOKENIZER)
        self.tokenizer, self.generation_config, self.is_sleeping = TOKENIZER, None, False
        self.images, self.takes_images, self.prompts = images, images, []
        self.refuse = refuse  # a ValueError prepare raises for a prompt with images
        self.config = SimpleNamespace(
            model_config=SimpleNamespace(model="/m", served_model_names=["m"]),
            structured_outputs_config=SimpleNamespace(
                reasoning_parser_name=None, reasoning_parser_plugin=None
            ),
            lora_config=SimpleNamespace(enable_lora=False),
            multimodal_config=MultiModalConfig(allowed_local_media_path=media_path),
        )

    def check_admission(self, num_seqs: int) -> None:
        """No admission caps."""

    def prepare(self, prompt, params, lora_request=None) -> PreparedPrompt:
        self.prompts.append(prompt)
        if "multi_modal_data" not in prompt:
            return PreparedPrompt(None, list(prompt["prompt_token_ids"]), params)
        if self.refuse:
            raise ValueError(self.refuse)
        ids = TOKENIZER.encode(prompt["prompt"], add_special_tokens=False)
        return PreparedPrompt(prompt["prompt"], ids, params)

    async def generate(self, prepared, params, request_id, priority=0):
        seqs = [CompletionOutput(0, "ok", [79, 75], None, None, "stop")]
        yield RequestOutput(request_id, prepared.text, prepared.token_ids, None, seqs, True)


def client(*argv: str, **engine) -> tuple[TestClient, FakeEngine]:
    fake = FakeEngine(**engine)
    args = add_server_args(FlexibleArgumentParser()).parse_args(list(argv))
    return TestClient(build_app(fake, args)), fake


def png_url(color: tuple[int, int, int]) -> str:
    out = BytesIO()
    Image.new("RGB", (2, 2), color).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


RED, GREEN, BLUE = (255, 0, 0), (0, 255, 0), (0, 0, 255)


def image(url) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def text(t: str) -> dict:
    return {"type": "text", "text": t}


MESSAGES = [
    {"role": "system", "content": "Be brief"},
    {"role": "user", "content": [text("Compare"), image(png_url(RED)), text("and")]},
    {"role": "assistant", "content": "OK"},
    {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": png_url(GREEN)},  # the shorthand
            image(png_url(BLUE)),
            text("which?"),
        ],
    },
]


def chat(http: TestClient, messages=MESSAGES, **fields):
    body = {"messages": messages, "max_tokens": 2, **fields}
    return http.post("/v1/chat/completions", json=body)


def test_images_reach_the_engine_beside_the_text_in_order():
    http, engine = client()
    reply = chat(http, mm_processor_kwargs={"do_resize": False})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == "ok"
    (prompt,) = engine.prompts
    assert prompt["prompt"] == (
        "<system>Be brief<user>Compare<image>and<assistant>OK<user><image><image>which?<assistant>"
    )
    images = prompt["multi_modal_data"]["image"]
    assert [(i.mode, i.getpixel((0, 0))) for i in images] == [
        ("RGB", RED),
        ("RGB", GREEN),
        ("RGB", BLUE),
    ]
    assert prompt["mm_processor_kwargs"] == {"do_resize": False}
    assert set(prompt) == {
        "prompt",
        "multi_modal_data",
        "mm_processor_kwargs",
        "add_special_tokens",
    }
    assert prompt["add_special_tokens"] is False  # the template rendered them
    streamed = chat(http, stream=True, add_special_tokens=True)
    assert streamed.status_code == 200 and '"content":"ok"' in streamed.text.replace(" ", "")
    assert engine.prompts[1]["prompt"].startswith("<s><system>")  # the BOS text first
    assert engine.prompts[1]["mm_processor_kwargs"] is None


def test_without_images_the_prompt_is_token_ids():
    http, engine = client()
    messages = [{"role": "user", "content": [text("Hi")]}]
    assert chat(http, messages, mm_processor_kwargs={"x": 1}).status_code == 200
    expected = TOKENIZER.encode("<user>Hi<assistant>", add_special_tokens=False)
    assert engine.prompts == [{"prompt_token_ids": expected}]


@pytest.mark.parametrize(
    "argv",
    [("--chat-template", TEXT_ONLY), ("--chat-template-content-format", "string")],
    ids=["string-template", "string-format"],
)
def test_a_template_over_strings_refuses_images(argv):
    http, engine = client(*argv)
    reply = chat(http)
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == NO_IMAGE_TEMPLATE
    assert engine.prompts == []
    with pytest.raises(APIError, match="does not support images"):
        normalize_message(MESSAGES[1], "string")
    assert normalize_message(MESSAGES[1], "openai")["content"] == [
        text("Compare"),
        {"type": "image"},
        text("and"),
    ]


def test_images_to_a_text_only_model_are_a_400_before_any_fetch():
    http, fake = client(images=False)
    reply = chat(http)
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == NOT_MULTIMODAL
    assert fake.prompts == []


def test_what_the_engine_refuses_is_a_400():
    too_many = "At most 1 image(s) may be provided in one prompt."
    http, _ = client(refuse=too_many)
    reply = chat(http)
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == too_many


@pytest.mark.parametrize(
    "url, needle",
    [
        ("data:image/png;base64,AAAA", "cannot decode the image"),
        ("file:///etc/hostname", "--allowed-local-media-path DIR"),
        ("gopher://x/y.png", "scheme 'gopher' is not supported"),
    ],
)
def test_an_image_that_does_not_load_is_a_400(url, needle):
    http, engine = client()
    messages = [{"role": "user", "content": [image(png_url(RED)), image(url)]}]
    error = chat(http, messages).json()["error"]
    assert (error["code"], error["param"]) == (400, "messages")
    assert needle in error["message"]
    assert engine.prompts == []  # nothing prepared, nothing queued


@pytest.mark.parametrize(
    "part, needle",
    [
        ({"type": "image_url", "image_url": {}}, 'needs "image_url": {"url": "..."}'),
        ({"type": "input_audio", "input_audio": {}}, "'input_audio' is not supported"),
    ],
)
def test_bad_parts_are_400s(part, needle):
    http, _ = client()
    reply = chat(http, [{"role": "user", "content": [part]}])
    assert reply.status_code == 400 and needle in reply.json()["error"]["message"]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
        ({"use_beam_search": True}, "use_beam_search"),
    ],
)
def test_what_images_cannot_run_with_is_refused(fields, param):
    http, engine = client()
    error = chat(http, **fields).json()["error"]
    assert (error["code"], error["param"]) == (400, param) and "with images" in error["message"]
    assert engine.prompts == []


def test_tokenize_refuses_images():
    http, _ = client()
    reply = http.post("/tokenize", json={"messages": MESSAGES})
    assert reply.status_code == 400 and reply.json()["error"]["message"] == NOT_HERE
    plain = http.post("/tokenize", json={"messages": [MESSAGES[0]], "add_special_tokens": False})
    assert plain.json()["tokens"] == TOKENIZER.encode("<system>Be brief<assistant>")


def test_local_images_follow_the_engine_media_flag(tmp_path):
    (tmp_path / "red.png").write_bytes(base64.b64decode(png_url(RED).split(",")[1]))
    messages = [{"role": "user", "content": [image((tmp_path / "red.png").as_uri())]}]
    http, engine = client(media_path=str(tmp_path))
    assert chat(http, messages).status_code == 200
    assert engine.prompts[0]["multi_modal_data"]["image"][0].getpixel((1, 1)) == RED
    refused, _ = client()  # the flag unset: file:// is refused
    assert "--allowed-local-media-path" in chat(refused, messages).json()["error"]["message"]


@pytest.mark.parametrize("with_images", [True, False], ids=["images", "text"])
def test_a_chat_request_takes_one_pass(monkeypatch, with_images):
    """Each step of the chat path runs once per request (issue 59's one pass): the one
    scan of the messages for images, the template resolved and applied once (each
    message normalized once), the images fetched once, the tool choice, structured
    outputs and sampling parameters built once, the engine's ``prepare`` called once.
    Counted by wrapping the handler module's collaborators."""
    import server.chat.serving as serving

    calls: dict[str, int] = {}
    names = ["image_urls", "resolve_chat_template", "apply_chat_template", "normalize_message",
             "load_images", "image_prompt", "resolve_tool_choice", "structured_outputs_params",
             "content_format", "request_template"]  # fmt: skip
    for name in names:
        original = getattr(serving, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(serving, name, counted)
    prepare = FakeEngine.prepare
    monkeypatch.setattr(
        FakeEngine,
        "prepare",
        lambda self, *a, **k: (calls.__setitem__("prepare", calls.get("prepare", 0) + 1),
                               prepare(self, *a, **k))[1],
    )  # fmt: skip
    http, _ = client()
    messages = MESSAGES if with_images else [{"role": "user", "content": "Hi"}]
    assert chat(http, messages).status_code == 200
    once = {
        n: 1 for n in [*names, "prepare"] if with_images or n not in ("load_images", "image_prompt")
    }
    once["normalize_message"] = len(messages)
    assert calls == once
