"""LoRA in the OpenAI server without an engine: ``--lora-modules`` parsing, the
runtime-updating permission, `ServingModels` and the HTTP routes over a fake engine,
and the ``lora_requests_info`` gauge from synthetic stats (the real server:
tests/server/test_lora.py)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from jaxengine.config import MultiModalConfig
from jaxengine.config.arg_utils import FlexibleArgumentParser
from jaxengine.core.sched_output import SchedulerStats
from jaxengine.lora import LoRAAdapterError, LoRAAdapterNotFoundError
from jaxengine.metrics.loggers import PrometheusStatLogger, render_metrics
from server.api_server.args import add_server_args, check_server_args
from server.errors import APIError
from server.lora import (
    LoadLoRAAdapterRequest,
    LoRAModulePath,
    ServingModels,
    UnloadLoRAAdapterRequest,
    parse_lora_module,
    runtime_updating_allowed,
)

ENV = "JAXENGINE_ALLOW_RUNTIME_LORA_UPDATING"

# ---------------------------------------------------------------------- flags


@pytest.mark.parametrize(
    "text, want",
    [
        ("a1=/x/y", LoRAModulePath("a1", "/x/y")),
        (" a1 = /x=y ", LoRAModulePath("a1", "/x=y")),
        ('{"name": "a", "path": "/p"}', LoRAModulePath("a", "/p")),
        ('{"name": "a", "path": "/p", "base_model_name": "m"}', LoRAModulePath("a", "/p", "m")),
    ],
)
def test_parse_lora_module(text, want):
    assert parse_lora_module(text) == want


@pytest.mark.parametrize(
    "text, needle",
    [
        ("a1", "name=path"),
        ("=/p", "name=path"),
        ("a=", "name=path"),
        ('{"name": "a"', "invalid JSON"),
        ('{"name": "a"}', "name and path"),
        ('{"name": "a", "path": "/p", "rank": 8}', "unknown fields ['rank']"),
        ('{"name": "a", "path": "/p", "base_model_name": 3}', "base_model_name"),
    ],
)
def test_parse_lora_module_refuses(text, needle):
    with pytest.raises(argparse.ArgumentTypeError, match=needle.replace("[", r"\[")):
        parse_lora_module(text)


def serve_args(*argv: str) -> argparse.Namespace:
    return add_server_args(FlexibleArgumentParser()).parse_args(list(argv))


def test_lora_modules_flag():
    args = serve_args(
        "--enable-lora", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}',
        "--lora-modules", "c=/z",
    )  # fmt: skip
    assert [m.name for m in args.lora_modules] == ["a", "b", "c"]
    check_server_args(args)
    assert serve_args().lora_modules == []
    with pytest.raises(ValueError, match="--lora-modules requires --enable-lora"):
        check_server_args(serve_args("--lora-modules", "a=/x"))
    with pytest.raises(ValueError, match=r"\['a'\] are given more than once"):
        check_server_args(serve_args("--enable-lora", "--lora-modules", "a=/x", "a=/y"))


@pytest.mark.parametrize(
    "environ, allowed",
    [
        ({}, False),
        ({ENV: "0"}, False),
        ({ENV: "1"}, True),
        ({ENV: " True "}, True),
        ({ENV: "yes"}, False),
        ({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}, True),
    ],
)
def test_runtime_updating_env(environ, allowed):
    assert runtime_updating_allowed(environ) is allowed


# ---------------------------------------------------------------------- a fake engine


def not_found(lora) -> LoRAAdapterNotFoundError:
    return LoRAAdapterNotFoundError(
        f"Loading lora {lora.lora_name} failed: No adapter found for {lora.lora_path}"
    )


class FakeEngine:
    """What `ServingModels` and `build_app` read of an engine; an adapter folder
    named "bad" is refused as the engine would refuse it, one named "missing" is not
    found, and one named "gone" is found when loaded but not when a request reads it
    again."""

    def __init__(self) -> None:
        self.loaded: dict[int, str] = {}
        self.removed: list[int] = []
        self.prepared: list = []  # the lora_request of every prepare call
        self.max_model_len = 512
        self.vocab_size = 100
        self.tokenizer = None
        self.generation_config = None
        self.is_sleeping = False  # (sleep mode: the generation routes ask)
        self.config = SimpleNamespace(
            model_config=SimpleNamespace(model="/models/base", served_model_names=["base", "b2"]),
            structured_outputs_config=SimpleNamespace(
                reasoning_parser_name=None, reasoning_parser_plugin=None
            ),
            lora_config=SimpleNamespace(enable_lora=True),
            multimodal_config=MultiModalConfig(),
        )

    async def add_lora(self, lora) -> bool:
        if Path(lora.lora_path).name == "bad":
            raise LoRAAdapterError(f"{lora.lora_path}: rank 16 > --max-lora-rank 8")
        if Path(lora.lora_path).name == "missing":
            raise not_found(lora)
        self.loaded[lora.lora_int_id] = lora.lora_name
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        self.removed.append(lora_id)
        return self.loaded.pop(lora_id, None) is not None

    def prepare(self, prompt, params, lora_request=None):
        """Records the adapter, then refuses the prompt (nothing is generated)."""
        self.prepared.append(lora_request)
        if lora_request is not None and Path(lora_request.lora_path).name == "gone":
            raise not_found(lora_request)
        raise ValueError("prepared")


def load(models, name, path):
    return asyncio.run(models.load(LoadLoRAAdapterRequest(lora_name=name, lora_path=path)))


def unload(models, name, lora_int_id=None):
    request = UnloadLoRAAdapterRequest(lora_name=name, lora_int_id=lora_int_id)
    return asyncio.run(models.unload(request))


def api_error(call, *args) -> APIError:
    with pytest.raises(APIError) as info:
        call(*args)
    return info.value


def test_serving_models_resolve_and_cards():
    engine = FakeEngine()
    models = ServingModels(engine, ["base", "b2"])
    modules = [LoRAModulePath("a1", "/l/a1"), LoRAModulePath("a2", "/l/a2", "b2")]
    asyncio.run(models.add_static(modules))
    assert engine.loaded == {1: "a1", 2: "a2"}
    assert models.resolve(None) == ("base", None)
    assert models.resolve("b2") == ("b2", None)
    name, lora = models.resolve("a2")
    assert (name, lora.lora_int_id, lora.lora_path) == ("a2", 2, "/l/a2")
    error = api_error(models.resolve, "nope")
    assert (error.status, error.message) == (404, "The model `nope` does not exist.")
    cards = {c["id"]: (c["root"], c["parent"]) for c in models.cards()}
    assert cards == {
        "base": ("/models/base", None),
        "b2": ("/models/base", None),
        "a1": ("/l/a1", "base"),
        "a2": ("/l/a2", "b2"),
    }


def test_static_modules_that_cannot_be_served():
    with pytest.raises(ValueError, match="--lora-modules x=/l/bad: /l/bad: rank 16"):
        asyncio.run(
            ServingModels(FakeEngine(), ["base"]).add_static([LoRAModulePath("x", "/l/bad")])
        )
    with pytest.raises(ValueError, match="a served model name"):
        asyncio.run(
            ServingModels(FakeEngine(), ["base"]).add_static([LoRAModulePath("base", "/l")])
        )


def test_runtime_load_and_unload():
    engine = FakeEngine()
    models = ServingModels(engine, ["base"])
    asyncio.run(models.add_static([LoRAModulePath("a1", "/l/a1")]))
    assert load(models, "a2", "/l/a2") == "Success: LoRA adapter 'a2' added successfully."
    assert models.resolve("a2")[1].lora_int_id == 2
    error = api_error(load, models, "a2", "/l/other")
    assert (error.status, error.message) == (400, "The lora adapter 'a2' has already been loaded.")
    error = api_error(load, models, "a3", "/l/bad")
    assert (error.status, error.message) == (400, "/l/bad: rank 16 > --max-lora-rank 8")
    assert api_error(models.resolve, "a3").status == 404
    assert api_error(load, models, "", "/l/x").message.startswith("Both 'lora_name'")
    assert api_error(load, models, "base", "/l/x").status == 400
    assert load(models, "a3", "/l/a3") and models.resolve("a3")[1].lora_int_id == 4  # 3 spent
    error = api_error(unload, models, "zz")
    assert (error.status, error.message) == (404, "The lora adapter 'zz' cannot be found.")
    assert api_error(unload, models, "a2", 7).status == 400
    assert unload(models, "a2", 2) == "Success: LoRA adapter 'a2' removed successfully."
    assert engine.removed == [2] and api_error(models.resolve, "a2").status == 404
    assert load(models, "a2", "/l/a2") and models.resolve("a2")[1].lora_int_id == 5  # not reused
    assert [c["id"] for c in models.cards()] == ["base", "a1", "a3", "a2"]


def fake_app(monkeypatch, allow: str, enable_lora: bool = True):
    from server.api_server.app import build_app

    monkeypatch.setenv(ENV, allow)
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    engine = FakeEngine()
    engine.config.lora_config.enable_lora = enable_lora
    return TestClient(build_app(engine, serve_args("--enable-lora"))), engine


def test_routes_over_a_fake_engine(monkeypatch):
    client, engine = fake_app(monkeypatch, "1")
    body = {"lora_name": "a1", "lora_path": "/l/a1"}
    reply = client.post("/v1/load_lora_adapter", json=body)
    assert (reply.status_code, reply.text) == (
        200,
        "Success: LoRA adapter 'a1' added successfully.",
    )
    assert reply.headers["content-type"].startswith("text/plain")
    models = client.get("/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in models] == [
        ("base", None),
        ("b2", None),
        ("a1", "base"),
    ]
    reply = client.post("/v1/load_lora_adapter", json=body)
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == "The lora adapter 'a1' has already been loaded."
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "x"}).status_code == 400
    reply = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/bad"})
    assert reply.status_code == 400 and "rank 16" in reply.json()["error"]["message"]
    reply = client.post("/v1/unload_lora_adapter", json={"lora_name": "zz"})
    assert reply.status_code == 404
    assert reply.json()["error"] == {
        "message": "The lora adapter 'zz' cannot be found.",
        "type": "NotFoundError",
        "param": None,
        "code": 404,
    }
    reply = client.post("/v1/completions", json={"model": "a1", "prompt": [1, 2]})
    assert reply.status_code == 400 and engine.prepared[-1].lora_name == "a1"
    reply = client.post("/v1/completions", json={"model": "b2", "prompt": [1, 2]})
    assert reply.status_code == 400 and engine.prepared[-1] is None
    reply = client.post("/v1/unload_lora_adapter", json={"lora_name": "a1"})
    assert (reply.status_code, reply.text) == (
        200,
        "Success: LoRA adapter 'a1' removed successfully.",
    )
    reply = client.post("/v1/completions", json={"model": "a1", "prompt": [1, 2]})
    assert reply.status_code == 404
    assert reply.json()["error"]["message"] == "The model `a1` does not exist."


def test_an_adapter_that_is_not_there_is_404(monkeypatch):
    """vLLM's NotFoundError (the openai client raises NotFoundError): loading a path
    with no adapter, and a request whose adapter's folder is gone (the engine reads
    it again for the request). A bad adapter stays a 400."""
    client, _ = fake_app(monkeypatch, "1")
    body = {"lora_name": "m", "lora_path": "/l/missing"}
    reply = client.post("/v1/load_lora_adapter", json=body)
    assert reply.status_code == 404
    assert reply.json()["error"] == {
        "message": "Loading lora m failed: No adapter found for /l/missing",
        "type": "NotFoundError",
        "param": None,
        "code": 404,
    }
    body = {"lora_name": "g", "lora_path": "/l/gone"}
    assert client.post("/v1/load_lora_adapter", json=body).status_code == 200
    reply = client.post("/v1/completions", json={"model": "g", "prompt": [1, 2]})
    assert reply.status_code == 404
    assert reply.json()["error"]["message"] == "Loading lora g failed: No adapter found for /l/gone"
    body = {"lora_name": "b", "lora_path": "/l/bad"}
    assert client.post("/v1/load_lora_adapter", json=body).status_code == 400


@pytest.mark.parametrize("allow, enable_lora", [("0", True), ("1", False)])
def test_runtime_routes_are_off(monkeypatch, allow, enable_lora):
    client, _ = fake_app(monkeypatch, allow, enable_lora)
    body = {"lora_name": "a1", "lora_path": "/l/a1"}
    assert client.post("/v1/load_lora_adapter", json=body).status_code == 404
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a1"}).status_code == 404


def test_start_up_stops_on_a_bad_adapter():
    from server.api_server.launch import _serve

    served = []
    server = SimpleNamespace(serve=lambda: served.append(True))
    models = ServingModels(FakeEngine(), ["base"])
    with pytest.raises(ValueError, match="rank 16"):
        asyncio.run(_serve(server, models, [LoRAModulePath("x", "/l/bad")], "here"))
    assert not served


# ---------------------------------------------------------------------- the gauge


def lora_series(metrics: PrometheusStatLogger) -> list[tuple[dict, float]]:
    body, _ = render_metrics(metrics.registry)
    return [
        (s.labels, s.value)
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
        if s.name == "jaxengine:lora_requests_info"
    ]


def lora_stats(max_lora: int, running: dict, waiting: dict) -> SchedulerStats:
    return SchedulerStats(2, 1, 0, 0.1, 0, 0, 0, running, waiting, max_lora)


def test_lora_requests_info_gauge():
    metrics = PrometheusStatLogger("m")
    metrics.record(lora_stats(0, {}, {}), None)
    body, _ = render_metrics(metrics.registry)
    assert b"lora_requests_info" not in body  # LoRA off: no family at all
    metrics.record(lora_stats(2, {"b": 1, "a": 1}, {"c": 1}), None)
    [(labels, value)] = lora_series(metrics)
    assert labels == {
        "model_name": "m",
        "engine": "0",
        "max_lora": "2",
        "waiting_lora_adapters": "c",
        "running_lora_adapters": "a,b",
    }
    assert value > 1.6e9  # a Unix timestamp
    metrics.record(lora_stats(2, {}, {}), None)
    [(labels, _)] = lora_series(metrics)  # the new snapshot replaced the old series
    assert labels["running_lora_adapters"] == labels["waiting_lora_adapters"] == ""
