"""Child processes for the multi-process tests (tests/sharding/test_multihost.py,
tests/server/test_dp_multinode.py): each started in its own session with its output
in a log file, and every process group killed at the end, whatever happened."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

HEALTH_POLL_S = 0.2
"""How often a starting server's /health is asked (a poll costs a refused connection)."""


def child_env(**extra: str) -> dict[str, str]:
    """The test's environment for a child, minus its device count (children set theirs)."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "RAY_ADDRESS")}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags)
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **extra)
    return env


class Children:
    """Child processes, each in its own session, logged to files; all killed at exit."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115 - the child owns it
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        self.procs[name] = proc
        return proc

    def log(self, name: str, lines: int = 40) -> str:
        text = (self.log_dir / f"{name}.log").read_text(errors="replace")
        return f"--- {name}:\n" + "\n".join(text.splitlines()[-lines:])

    def logs(self) -> str:
        return "\n".join(self.log(name) for name in self.procs)

    def wait(self, name: str, timeout: float) -> int:
        try:
            return self.procs[name].wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} did not finish in {timeout:.0f}s\n{self.logs()}")

    def kill_all(self) -> None:
        for proc in self.procs.values():
            for sig in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)  # the group: the child and what it started
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)


def wait_healthy(url: str, children: Children, timeout: float) -> None:
    """Waits until ``url``/health answers 200; fails at once if any child exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, proc in children.procs.items():
            if proc.poll() is not None:
                pytest.fail(f"{name} exited with {proc.returncode}\n{children.logs()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(HEALTH_POLL_S)
    pytest.fail(f"{url} was not healthy after {timeout:.0f}s\n{children.logs()}")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
