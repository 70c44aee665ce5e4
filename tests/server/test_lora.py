"""LoRA adapters through a real OpenAI server: ``--lora-modules``, the ``model``
field, `/v1/models`, runtime loading and unloading, refused adapters and the
``lora_requests_info`` gauge.

One server for the module: the tiny random Llama with SmolLM2's tokenizer (the
`tiny_smollm2` fixture) with three adapters made by peft for its shapes and two
device slots (so a mixed load queues); every adapter's greedy tokens are checked
against its PEFT model. The pieces without an engine: tests/unit/test_server_lora.py.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import ALIAS, MODEL, SERVER_FLAGS, start_server, stop_server

ENV = "JAXENGINE_ALLOW_RUNTIME_LORA_UPDATING"

# ---------------------------------------------------------------------- a real server

NEW_TOKENS = 8
SEEDS = {"a1": 1, "a2": 2, "a3": 3, "a4": 4}
"""a1-a3 are served from start-up (a3's parent given as the alias), a4 is loaded at run time."""
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time"]


@pytest.fixture(scope="module")
def adapters(tiny_smollm2, tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """name -> (PEFT folder, PEFT model); None -> the base model; "r16" has rank 16."""
    from tests.lora_adapters import make_adapter

    base = tiny_smollm2[1]
    root = tmp_path_factory.mktemp("adapters")
    made: dict = {None: (None, base)}
    for name, seed in SEEDS.items():
        made[name] = (root / name, make_adapter(base, root / name, seed=seed, r=8))
    made["r16"] = (root / "r16", make_adapter(base, root / "r16", seed=9, r=16))
    return made


@pytest.fixture(scope="module")
def server(tiny_smollm2, adapters, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server-lora") / "server.log"
    a3 = {"name": "a3", "path": str(adapters["a3"][0]), "base_model_name": ALIAS}
    flags = [
        str(tiny_smollm2[0]),
        *SERVER_FLAGS, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
        "--lora-modules", f"a1={adapters['a1'][0]}", f"a2={adapters['a2'][0]}", json.dumps(a3),
    ]  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENV, "1")
        running = start_server(log_path, flags)
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def expected(server, adapters):
    """expected(model, ids): the PEFT model's greedy tokens (cached)."""
    from tests.models.hf_reference import hf_greedy

    cache: dict = {}

    def greedy(model: str | None, ids: list[int]) -> list[int]:
        key = (model, tuple(ids))
        if key not in cache:
            cache[key] = hf_greedy(adapters[model][1], ids, NEW_TOKENS)
        return cache[key]

    return greedy


def tokenize(server, model: str | None, **body) -> list[int]:
    reply = server.post("/tokenize", {"model": model, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()["tokens"]


def completion_ids(choice) -> list[int]:
    """Generated ids, from logprobs' ``token_id:N`` tokens."""
    return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]


GREEDY = dict(
    max_tokens=NEW_TOKENS,
    temperature=0,
    logprobs=0,
    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
)


def test_models_lists_adapters(server, adapters):
    data = {m.id: m for m in server.client().models.list().data}
    assert list(data) == [MODEL, ALIAS, "a1", "a2", "a3"]
    assert data[MODEL].parent is None
    for name, parent in (("a1", MODEL), ("a2", MODEL), ("a3", ALIAS)):
        assert (data[name].root, data[name].parent) == (str(adapters[name][0]), parent)


@pytest.mark.parametrize("model", [MODEL, "a1", "a2", "a3"])
def test_completion_matches_peft(server, expected, model):
    client = server.client(max_retries=0, timeout=120)
    ids = tokenize(server, model, prompt=PROMPTS[0])
    reply = client.completions.create(model=model, prompt=PROMPTS[0], **GREEDY)
    assert reply.model == model
    lora = None if model == MODEL else model
    assert completion_ids(reply.choices[0]) == expected(lora, ids)
    if lora is not None:  # the adapter changes the output, so the test can see it
        assert expected(lora, ids) != expected(None, ids)


def test_chat_with_an_adapter(server, expected):
    messages = [{"role": "user", "content": "Name a colour."}]
    ids = tokenize(server, "a2", messages=messages)
    reply = server.client(max_retries=0, timeout=120).chat.completions.create(
        model="a2",
        messages=messages,
        max_tokens=NEW_TOKENS,
        temperature=0,
        logprobs=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    assert reply.model == "a2"
    got = [int(t.token.removeprefix("token_id:")) for t in reply.choices[0].logprobs.content]
    assert got == expected("a2", ids)
    # the APIs over chat take the adapter from ``model`` too: the same greedy text
    chat = server.client(max_retries=0, timeout=120).chat.completions.create(
        model="a2", messages=messages, max_tokens=NEW_TOKENS, temperature=0
    )
    text = chat.choices[0].message.content
    body = {"model": "a2", "input": messages, "max_output_tokens": NEW_TOKENS, "temperature": 0}
    response = server.post("/v1/responses", body).json()
    assert response["model"] == "a2"
    assert response["output"][-1]["content"][0]["text"] == text
    body = {"model": "a2", "messages": messages, "max_tokens": NEW_TOKENS, "temperature": 0}
    message = server.post("/v1/messages", body).json()
    assert message["model"] == "a2" and message["content"][0]["text"] == text


def test_mixed_load_over_more_adapters_than_slots(server, expected):
    """12 requests over the base and 3 adapters with 2 slots: some wait for a slot."""
    jobs = [(model, p) for p in PROMPTS for model in (MODEL, "a1", "a2", "a3")]
    ids = {p: tokenize(server, None, prompt=p) for p in PROMPTS}

    async def run_all():
        async with server.async_client(max_retries=0, timeout=300) as client:
            calls = [client.completions.create(model=m, prompt=p, **GREEDY) for m, p in jobs]
            return await asyncio.gather(*calls)

    replies = asyncio.run(run_all())
    for (model, prompt), reply in zip(jobs, replies, strict=True):
        lora = None if model == MODEL else model
        assert reply.model == model
        assert completion_ids(reply.choices[0]) == expected(lora, ids[prompt]), (model, prompt)


def test_runtime_load_use_unload(server, adapters, expected):
    path = str(adapters["a4"][0])
    reply = server.post("/v1/load_lora_adapter", {"lora_name": "a4", "lora_path": path})
    assert (reply.status_code, reply.text) == (
        200,
        "Success: LoRA adapter 'a4' added successfully.",
    )
    again = server.post("/v1/load_lora_adapter", {"lora_name": "a4", "lora_path": path})
    assert again.status_code == 400
    assert again.json()["error"]["message"] == "The lora adapter 'a4' has already been loaded."
    client = server.client(max_retries=0, timeout=120)
    cards = {m.id: m for m in client.models.list().data}
    assert (cards["a4"].root, cards["a4"].parent) == (path, MODEL)
    ids = tokenize(server, "a4", prompt=PROMPTS[1])
    reply = client.completions.create(model="a4", prompt=PROMPTS[1], **GREEDY)
    assert completion_ids(reply.choices[0]) == expected("a4", ids) != expected(None, ids)
    reply = server.post("/v1/unload_lora_adapter", {"lora_name": "a4"})
    assert (reply.status_code, reply.text) == (
        200,
        "Success: LoRA adapter 'a4' removed successfully.",
    )
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="a4", prompt=PROMPTS[1], max_tokens=2)
    assert "a4" not in {m.id for m in client.models.list().data}
    reply = server.post("/v1/unload_lora_adapter", {"lora_name": "a4"})
    assert reply.status_code == 404
    assert reply.json()["error"]["message"] == "The lora adapter 'a4' cannot be found."


def a1_with(folder: Path, adapters, **config) -> Path:
    """A copy of adapter a1 with ``config`` changed in its adapter_config.json."""
    shutil.copytree(adapters["a1"][0], folder)
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return folder


def test_bad_adapters_are_refused(server, adapters, tmp_path, expected):
    """400s naming the folder, as vLLM's BadRequestError, in vLLM's words (its
    test_dynamic_lora_badrequests and test_dynamic_lora_invalid_files): a rank above
    --max-lora-rank (in the tensors, or only in the config's r), DoRA, modules_to_save,
    a PiSSA adapter (made over rewritten base weights), a config that is not JSON,
    corrupt weights."""
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    config = adapters["a1"][0] / "adapter_config.json"
    (corrupt / "adapter_config.json").write_text(config.read_text())
    (corrupt / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    not_json = a1_with(tmp_path / "not-json", adapters)
    (not_json / "adapter_config.json").write_text("this is not json")
    bad = {
        "r16": adapters["r16"][0],
        "config-r16": a1_with(tmp_path / "config-r16", adapters, r=16),
        "dora": a1_with(tmp_path / "dora", adapters, use_dora=True),
        "saved": a1_with(tmp_path / "saved", adapters, modules_to_save=["lm_head"]),
        "pissa": a1_with(tmp_path / "pissa", adapters, init_lora_weights="pissa"),
        "not-json": not_json,
        "corrupt": corrupt,
    }
    messages = {}
    for name, path in bad.items():
        reply = server.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        assert reply.status_code == 400, (name, reply.text)
        messages[name] = reply.json()["error"]["message"]
        assert str(path) in messages[name], name  # the engine's message names the folder
    assert "LoRA rank 16 is greater than max_lora_rank 8" in messages["r16"]
    assert "LoRA rank 16 is greater than max_lora_rank 8" in messages["config-r16"]
    assert "init_lora_weights='pissa'" in messages["pissa"]
    assert "does not yet support DoRA" in messages["dora"]
    assert "only supports modules_to_save being None" in messages["saved"]
    assert "Unsupported modules_to_save: ['lm_head']" in messages["saved"]
    assert "adapter_config.json: cannot read" in messages["not-json"]
    assert server.post("/v1/load_lora_adapter", {"lora_name": "x"}).status_code == 400
    client = server.client(max_retries=0, timeout=120)
    assert not set(bad) & {m.id for m in client.models.list().data}
    ids = tokenize(server, None, prompt=PROMPTS[2])
    for model in (MODEL, "a1"):  # still serving, base and adapters alike
        reply = client.completions.create(model=model, prompt=PROMPTS[2], **GREEDY)
        assert completion_ids(reply.choices[0]) == expected(None if model == MODEL else model, ids)


def test_adapters_that_are_not_there_are_404(server, adapters, tmp_path):
    """vLLM's NotFoundError, worded as vLLM's: loading a path with no adapter, and a
    request for a loaded adapter whose folder was deleted after the host dropped it
    (two adapters fit the host: a1 and a2 push it out)."""
    client = server.client(max_retries=0, timeout=120)
    nowhere = tmp_path / "nowhere"
    with pytest.raises(openai.NotFoundError) as info:
        client.post(
            "load_lora_adapter", cast_to=str, body={"lora_name": "x", "lora_path": str(nowhere)}
        )
    assert info.value.body["message"] == f"Loading lora x failed: No adapter found for {nowhere}"
    folder = shutil.copytree(adapters["a4"][0], tmp_path / "gone")
    reply = server.post("/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": str(folder)})
    assert reply.status_code == 200, reply.text
    for model in ("a1", "a2"):
        client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=1)
    shutil.rmtree(folder)
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gone", prompt=PROMPTS[0], max_tokens=1)
    assert info.value.body["message"] == f"Loading lora gone failed: No adapter found for {folder}"
    assert server.post("/v1/unload_lora_adapter", {"lora_name": "gone"}).status_code == 200


def test_unknown_model_is_404(server):
    client = server.client(max_retries=0, timeout=120)
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert info.value.body == {
        "message": "The model `nope` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )


def test_lora_requests_info_is_exposed(server):
    server.client(max_retries=0, timeout=120).completions.create(
        model="a1", prompt="hi", max_tokens=2
    )
    series = [
        s
        for family in text_string_to_metric_families(server.get("/metrics").text)
        for s in family.samples
        if s.name == "jaxengine:lora_requests_info"
    ]
    assert series and all(s.labels["max_lora"] == "2" for s in series)
    assert all(s.labels["model_name"] == MODEL and s.value > 1.6e9 for s in series)
