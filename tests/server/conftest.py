"""A real `jaxengine serve` process for the server tests (one per session).

The server runs the default demo model on a free local port, with an API key, two
served names, and the optional endpoints and usage details switched on. Its log is
kept in a temporary file and printed when start-up fails.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
ALIAS = "smollm2"
SERVER_FLAGS = [
    "--api-key", API_KEY,
    "--served-model-name", MODEL, ALIAS,
    "--max-model-len", "512",
    "--max-num-seqs", "16",
    "--max-num-batched-tokens", "128",
    "--compile-token-buckets", "8", "32", "128",
    "--enable-prompt-tokens-details",
    "--enable-server-load-tracking",
    "--enable-request-id-headers",
    "--disable-uvicorn-access-log",
]  # fmt: skip
START_TIMEOUT = 900.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Server:
    """A running server: its URLs, key, process and log."""

    url: str
    api_key: str
    process: subprocess.Popen
    log_path: Path

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

    def metrics(self) -> dict[str, float]:
        """`/metrics` samples as {"name{labels}": value} (and bare names summed)."""
        text = self.get("/metrics").text
        samples: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
            bare = key.split("{", 1)[0]
            if bare != key:
                samples[bare] = samples.get(bare, 0.0) + float(value)
        return samples

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def start_server(log_path: Path, flags: list[str], timeout: float = START_TIMEOUT) -> Server:
    """Starts `jaxengine serve` and waits until /health answers 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "jaxengine.cli.main", "serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), *flags]
    log = open(log_path, "w")  # noqa: SIM115 - closed with the process
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
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
        time.sleep(1.0)
    stop_server(server)
    raise RuntimeError(f"server not healthy after {timeout:.0f}s:\n{server.log_tail()}")


def stop_server(server: Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(30)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


@pytest.fixture(scope="session")
def server(smollm2_gguf, tmp_path_factory) -> Server:
    """The shared server (default model; see SERVER_FLAGS)."""
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    running = start_server(log_path, SERVER_FLAGS)
    yield running
    stop_server(running)


@pytest.fixture(scope="session")
def client(server):
    return server.client(max_retries=0, timeout=120)


@pytest.fixture
def async_client(server):
    return server.async_client(max_retries=0, timeout=120)
