"""The CLI clients against the real server: `chat`, `complete` and `bench serve`.

Each runs as its own process through `jaxengine.cli.main`, as a user would run it.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.server.conftest import DP1_ONLY, MODEL


def jaxengine(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "jaxengine.cli.main", *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=300)


def test_complete_quick(server):
    done = jaxengine(
        "complete", "--url", server.base_url, "--api-key", server.api_key,
        "--max-tokens", "5", "--quick", "The capital of France is",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # sampled at the server's default temperature: one non-empty completion line
    assert done.stdout.endswith("\n") and done.stdout.strip()


def test_chat_interactive(server):
    done = jaxengine(
        "chat", "--url", server.base_url, "--api-key", server.api_key, "--max-tokens", "8",
        "--system-prompt", "You are terse.",
        stdin="What is the capital of France?\nAnd of Italy?\n",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # Sampled at the server's default temperature: check the shape, not the words.
    replies = [line.removeprefix("> ").strip() for line in done.stdout.split("\n> ")]
    assert done.stdout.startswith("> ") and len([r for r in replies if r]) == 2
    assert f"Using model: {MODEL}" in done.stderr


@DP1_ONLY
def test_chat_with_a_wrong_key_fails_cleanly(server):
    done = jaxengine("chat", "--url", server.base_url, "--api-key", "wrong", "--quick", "Hi")
    assert done.returncode == 1
    assert "401" in done.stderr and "Traceback" not in done.stderr


def test_bench_serve_report(server, tmp_path):
    done = jaxengine(
        "bench", "serve", "--base-url", server.url, "--api-key", server.api_key,
        "--num-prompts", "6", "--max-concurrency", "3", "--random-input-len", "16",
        "--random-output-len", "6", "--ignore-eos", "--disable-tqdm", "--save-result",
        "--result-dir", str(tmp_path), "--result-filename", "run.json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Serving Benchmark Result" in done.stdout
    assert "Successful requests:                     6" in done.stdout
    result = json.loads((tmp_path / "run.json").read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_output_tokens"] == 36  # 6 requests x 6 tokens, EOS ignored
    assert result["mean_ttft_ms"] > 0 and result["mean_itl_ms"] > 0
