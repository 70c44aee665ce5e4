"""A real `jaxengine serve` process for the server tests (one at a time per session).

The shared servers run the tiny random Llama with SmolLM2's vocabulary, tokenizer
and chat template (the `tiny_smollm2` fixture: two layers, so a step compiles in about
a second and a request costs little; two token buckets, 32 and 128, both of 16
requests, so one set of sampler variants) on a free local port, with an API key, two
served names, and the optional endpoints and usage details switched on. The tests
check the API, not the words, so its expectations come from the same server or the
same tiny model; the tests about the real model's answers start their own SmolLM2
server. Its log is kept in a temporary file and printed when start-up fails.

The `server` fixture is parametrized by the data-parallel size: every server test that
goes through the engine client runs against one engine (``dp1``) and against
``--data-parallel-size 2`` (``dp2``: two replicas on two virtual CPU devices); the
tests marked `DP1_ONLY` (answered before any request reaches an engine) run on
``dp1`` only. pytest groups the tests by parameter, so only one server runs at a
time.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.processes import HEALTH_POLL_S, free_port
from tests.xla_effort import OPTIMIZED

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
ALIAS = "smollm2"
SERVER_FLAGS = [
    "--api-key", API_KEY,
    "--served-model-name", MODEL, ALIAS,
    "--max-model-len", "512",
    "--max-num-seqs", "16",
    "--max-num-batched-tokens", "128",
    "--compile-token-buckets", "32", "128",
    "--enable-prompt-tokens-details",
    "--enable-server-load-tracking",
    "--enable-request-id-headers",
    "--disable-uvicorn-access-log",
]  # fmt: skip
START_TIMEOUT = 900.0
ENGINE_LABEL = re.compile(r'(?<=[{,])engine="\d+",?|,engine="\d+"(?=})')
DATA_PARALLEL_SIZES = [1, 2]


def with_flags(flags: list[str], changes: dict[str, str | list[str]]) -> list[str]:
    """``flags`` with each named flag's values replaced by those in ``changes``."""
    flags = list(flags)
    for name, value in changes.items():
        at = flags.index(name) + 1
        end = at + 1
        while end < len(flags) and not flags[end].startswith("--"):
            end += 1
        flags[at:end] = [value] if isinstance(value, str) else value
    return flags


@dataclasses.dataclass
class Server:
    """A running server: its URLs, key, process and log."""

    url: str
    api_key: str
    process: subprocess.Popen
    log_path: Path
    data_parallel_size: int = 1

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)

    def async_client(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)

    def post(self, path: str, body: dict, **kwargs) -> httpx.Response:
        headers = {**self.headers, **kwargs.pop("headers", {})}
        return httpx.post(self.url + path, json=body, headers=headers, timeout=120, **kwargs)

    def get(self, path: str, **kwargs) -> httpx.Response:
        headers = {**self.headers, **kwargs.pop("headers", {})}
        return httpx.get(self.url + path, headers=headers, timeout=60, **kwargs)

    def metrics(self, per_engine: bool = False) -> dict[str, float]:
        """`/metrics` samples as {"name{labels}": value} (and bare names summed).

        The ``engine`` label (one value per data-parallel replica) is summed away
        unless ``per_engine``, so the keys are the same whatever the replica count.
        """
        text = self.get("/metrics").text
        samples: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            if not per_engine:
                key = ENGINE_LABEL.sub("", key).replace("{}", "")
            samples[key] = samples.get(key, 0.0) + float(value)
            bare = key.split("{", 1)[0]
            if bare != key:
                samples[bare] = samples.get(bare, 0.0) + float(value)
        return samples

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def start_server(
    log_path: Path,
    flags: list[str],
    timeout: float = START_TIMEOUT,
    num_cpu_devices: int = 1,
    environ: dict[str, str] | None = None,
) -> Server:
    """Starts `jaxengine serve` and waits until /health answers 200.

    ``num_cpu_devices`` > 1 gives the process that many virtual CPU devices. The
    server compiles every bucket before it answers (``--no-background-compile``)
    unless ``flags`` say otherwise: the tests time requests (client timeouts) and must
    not meet a compile on the way; tests/engine/test_startup.py covers compiling in
    the background.
    """
    port = free_port()
    cmd = [sys.executable, "-m", "jaxengine.cli.main", "serve", "--host", "127.0.0.1"]
    if not any(f.endswith("background-compile") for f in flags):
        cmd.append("--no-background-compile")
    cmd += ["--port", str(port), *flags]
    log = open(log_path, "w")  # noqa: SIM115 - closed with the process
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(environ or {})}
    if num_cpu_devices > 1:
        count = f"--xla_force_host_platform_device_count={num_cpu_devices}"
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {count}".strip()
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = Server(f"http://127.0.0.1:{port}", API_KEY, process, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(HEALTH_POLL_S)
    stop_server(server)
    raise RuntimeError(f"server not healthy after {timeout:.0f}s:\n{server.log_tail()}")


def stop_server(server: Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(30)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


@pytest.fixture(
    scope="session", params=DATA_PARALLEL_SIZES, ids=[f"dp{n}" for n in DATA_PARALLEL_SIZES]
)
def server(request, tiny_smollm2, tmp_path_factory) -> Server:
    """The shared server (the tiny model; see SERVER_FLAGS), with 1 or 2 replicas; in
    sleep mode with vLLM's development routes on (test_rollout_routes.py)."""
    dp = request.param
    log_path = tmp_path_factory.mktemp(f"server-dp{dp}") / "server.log"
    flags = [str(tiny_smollm2[0]), *SERVER_FLAGS, "--data-parallel-size", str(dp)]
    flags.append("--enable-sleep-mode")
    environ = {**DEV_MODE, **OPTIMIZED}  # many tests' tokens (tests/xla_effort.py)
    running = start_server(log_path, flags, num_cpu_devices=dp, environ=environ)
    running.data_parallel_size = dp
    yield running
    stop_server(running)


DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}
"""The shared server's development routes (/sleep, /pause, /collective_rpc, ...)."""

DP1_ONLY = pytest.mark.parametrize("server", [1], ids=["dp1"], indirect=True)
"""For a test that never reaches the engine client: the API layer answers it (routes,
auth, request validation, tokenization), or the engine's `prepare` refuses the
request before it is queued (`DataParallelEngine.prepare` is its first replica's).
``dp2`` would assert the same again, so it runs on ``dp1`` only."""


SECOND_API_KEY = "second-test-key"
MAX_NUM_QUEUED_REQS = 8
"""`vllm_extras_server`'s admission cap: above any other test's n, under its traffic."""
VLLM_EXTRAS_FLAGS = [
    "--enable-force-include-usage",
    "--max-logprobs", "-1",
    "--enable-per-request-metrics",
    "--api-key", API_KEY, SECOND_API_KEY,
    "--max-num-queued-reqs", str(MAX_NUM_QUEUED_REQS),
]  # fmt: skip
"""The flags of `vllm_extras_server` on top of SERVER_FLAGS (its --api-key wins)."""


@pytest.fixture(scope="session")
def vllm_extras_server(tiny_smollm2, tmp_path_factory) -> Server:
    """One extra server (dp1, the tiny model) for vLLM's opt-in flags, shared by
    test_vllm_fields.py, test_per_request_metrics.py and test_admission.py:
    SERVER_FLAGS plus VLLM_EXTRAS_FLAGS (usage on every chunk, logprobs over the whole
    vocabulary, per-request timing metrics, an admission cap)."""
    log_path = tmp_path_factory.mktemp("server-vllm-extras") / "server.log"
    flags = [str(tiny_smollm2[0]), *SERVER_FLAGS, *VLLM_EXTRAS_FLAGS]
    running = start_server(log_path, flags)
    yield running
    stop_server(running)


TOOL_TEMPLATE = Path(__file__).with_name("tool_chat_template.jinja")
TOOL_FLAGS = [
    "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    "--chat-template", str(TOOL_TEMPLATE),
]  # fmt: skip
"""Tool calling: the hermes parser and a ChatML template that renders tools (for
messages without tools it renders as SmolLM2's own template)."""
SMOLLM2_BUCKETS = ["8", "32", "128"]
"""SmolLM2's decode steps stay at 8 tokens: at 32 its float32 step is compute bound on
one core (about twice the time of 8 rows, which only read the weights)."""
SMOLLM2_FLAGS = [
    *with_flags(
        SERVER_FLAGS, {"--max-model-len": "1024", "--compile-token-buckets": SMOLLM2_BUCKETS}
    ),
    *TOOL_FLAGS,
]
"""`smollm2_server`'s flags: SERVER_FLAGS with a longer context and SmolLM2's buckets,
and tool calling."""


@pytest.fixture(scope="session")
def smollm2_server(smollm2_gguf, tmp_path_factory) -> Server:
    """A server (dp1) of SmolLM2-135M-Instruct's real weights, for the tests about what
    the real model answers rather than the API: structured outputs and tool calls that
    close (test_structured_outputs.py), a chat beam that ends on EOS
    (test_beam_search_server.py)."""
    log_path = tmp_path_factory.mktemp("server-smollm2") / "server.log"
    # SmolLM2's 30 layers decode most of these tests' time (tests/xla_effort.py)
    running = start_server(log_path, [str(smollm2_gguf), *SMOLLM2_FLAGS], environ=OPTIMIZED)
    yield running
    stop_server(running)


@pytest.fixture(scope="session")
def client(server):
    return server.client(max_retries=0, timeout=120)


@pytest.fixture
def async_client(server):
    return server.async_client(max_retries=0, timeout=120)


AGENT_FLAGS = [*SERVER_FLAGS, *TOOL_FLAGS]
"""`agents_server`'s flags: SERVER_FLAGS plus tool calling."""


@pytest.fixture(scope="session")
def agents_server(tiny_smollm2, tmp_path_factory) -> Server:
    """One server (dp1, the tiny model, AGENT_FLAGS) for the agent-facing APIs built on
    chat completions: /v1/responses and Anthropic's /v1/messages, each compared with
    /v1/chat/completions on the same server."""
    log_path = tmp_path_factory.mktemp("server-agents") / "server.log"
    running = start_server(log_path, [str(tiny_smollm2[0]), *AGENT_FLAGS])
    yield running
    stop_server(running)
