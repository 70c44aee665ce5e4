"""The demo models' recommended sampling (`loader.demo`): SmolLM2-135M-Instruct's card
samples at temperature 0.2, top_p 0.9; Google's Gemma 3 card at temperature 1.0,
top_k 64, top_p 0.95. ``--generation-config auto`` reads them for a demo model as it
reads a folder's ``generation_config.json`` (`load_generation_config`), and the
server applies them to a request that sets none, while a request's own values win
(over a fake engine with the real demo's generation config; no model runs)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from jaxengine.config.arg_utils import FlexibleArgumentParser
from jaxengine.loader.demo import card_generation_config
from jaxengine.loader.hf_config import load_generation_config
from server.api_server.app import build_app
from server.api_server.args import add_server_args
from tests.unit.test_server_request_logs import FakeEngine, completion

SMOLLM2_CARD = {"temperature": 0.2, "top_p": 0.9}


def test_each_generating_demo_has_its_cards_sampling() -> None:
    assert card_generation_config("demo", "SmolLM2-135M-Instruct") == SMOLLM2_CARD
    assert card_generation_config("demo", "smollm2") == SMOLLM2_CARD  # an alias
    gemma = {"temperature": 1.0, "top_k": 64, "top_p": 0.95}
    assert card_generation_config("demo", "gemma-3-270m") == gemma
    assert card_generation_config("demo", "all-MiniLM-L6-v2") == {}  # embeddings only
    assert card_generation_config("gguf", "smollm2") == {}  # a file, not the demo name


def test_the_demo_names_generation_config_holds_the_card(smollm2_gguf) -> None:
    by_name = load_generation_config("SmolLM2-135M-Instruct")
    assert by_name == {**load_generation_config(smollm2_gguf), **SMOLLM2_CARD}
    assert by_name["eos_token_id"] == 2  # the GGUF's own fields stay
    assert "temperature" not in load_generation_config(smollm2_gguf)


class RecordingEngine(FakeEngine):
    def __init__(self, generation_config: dict) -> None:
        super().__init__()
        self.generation_config = generation_config
        self.params = []

    async def generate(self, prepared, params, request_id, priority=0):
        self.params.append(params)
        async for out in super().generate(prepared, params, request_id, priority):
            yield out


def test_the_server_applies_the_card_unless_the_request_says_otherwise(smollm2_gguf) -> None:
    engine = RecordingEngine(load_generation_config("SmolLM2-135M-Instruct"))
    args = add_server_args(FlexibleArgumentParser()).parse_args([])
    http = TestClient(build_app(engine, args))
    for fields in ({}, {"temperature": 0.7}, {"top_p": 1.0, "temperature": 0}):
        assert completion(http, **fields).status_code == 200
    plain, warmer, greedy = engine.params
    assert (plain.temperature, plain.top_p, plain.top_k) == (0.2, 0.9, 0)
    assert (warmer.temperature, warmer.top_p) == (0.7, 0.9)  # the request's value wins
    assert (greedy.temperature, greedy.top_p) == (0.0, 1.0)
