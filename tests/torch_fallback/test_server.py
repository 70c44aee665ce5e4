"""`jaxengine serve` on an architecture with no JAX port (GPT-2, tiny and random, with
SmolLM2's tokenizer and chat template), through ``--model-impl transformers``: a
subset of the server suite's completion and chat checks, unchanged."""

from __future__ import annotations

import pytest
import torch
import transformers

from jaxengine.loader.sources import resolve_model
from jaxengine.tokenizer import get_tokenizer
from tests.server.conftest import SERVER_FLAGS, start_server, stop_server
from tests.server.test_chat import (
    test_chat_shape_and_exact_usage,  # noqa: F401
    test_greedy_stream_matches_non_streamed,  # noqa: F401
)
from tests.server.test_chat import test_logprobs as test_chat_logprobs  # noqa: F401
from tests.server.test_completions import (  # noqa: F401
    test_completion_shape_and_exact_usage,  # noqa: F401
    test_greedy_is_repeatable_and_stream_matches,  # noqa: F401
    test_logprobs,
    test_logprobs_streamed,
)


@pytest.fixture(scope="module")
def gpt2_folder(smollm2_gguf, tmp_path_factory) -> str:
    tokenizer = get_tokenizer(resolve_model(str(smollm2_gguf)))
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("gpt2-served")
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def server(gpt2_folder, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server-gpt2") / "server.log"
    flags = [gpt2_folder, *SERVER_FLAGS, "--model-impl", "transformers"]
    running = start_server(log_path, flags)
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def client(server):
    return server.client(max_retries=0, timeout=120)


def test_the_server_runs_the_pytorch_model(server):
    assert "with transformers' GPT2LMHeadModel" in server.log_path.read_text(errors="replace")
