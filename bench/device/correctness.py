"""The correctness section: the ``gpu``-marked kernel tests, and the tiny families.

- ``pytest -m gpu tests/kernels`` in a subprocess with a time limit (on a GPU the
  Pallas GPU kernels compile through Triton and are checked against the reference on
  random ragged batches; elsewhere every one is skipped). The project's ``addopts``
  are cleared (``-o addopts=``: they name pytest-xdist, which a bare machine may
  lack); the counts come from the JUnit XML pytest writes. The subprocess starts
  first and runs while this process checks the families (on a GPU it takes the
  memory this process's JAX left: ``XLA_PYTHON_CLIENT_PREALLOCATE=false``).
- `bench.device.families`: Llama, Qwen3 and Gemma 3 built on the spot, the engine's
  float32 greedy tokens against transformers', and the bf16 agreement.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from bench.device import families
from bench.device.profile import Profile

ROOT = Path(__file__).resolve().parents[2]
PYTEST_ARGS = ("-m", "gpu", "tests/kernels", "-o", "addopts=", "-q", "-p", "no:cacheprovider")


class PytestRun:
    """``pytest -m gpu tests/kernels`` running in the background."""

    def __init__(self, junit: Path) -> None:
        self.junit = junit
        self.command = [sys.executable, "-m", "pytest", *PYTEST_ARGS, f"--junitxml={junit}"]
        env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
        self.log = tempfile.TemporaryFile(mode="w+")
        self.start = time.perf_counter()
        self.process = subprocess.Popen(
            self.command, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT
        )

    def result(self, timeout: float) -> dict[str, Any]:
        """Waits up to ``timeout`` seconds (then kills it) and reads the counts."""
        timed_out = False
        try:
            self.process.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            timed_out = True
            self.process.kill()
            self.process.wait()
        self.log.seek(0)
        text = self.log.read()
        self.log.close()
        out = {
            "command": " ".join(self.command[1:]),
            "returncode": self.process.returncode,
            "timed_out": timed_out,
            "seconds": time.perf_counter() - self.start,
            **(junit_counts(self.junit) or progress_counts(text)),
        }
        if timed_out or self.process.returncode not in (0, 5):  # 5: nothing collected
            out["output_tail"] = text[-3000:]
        return out

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def junit_counts(path: Path) -> dict[str, Any] | None:
    """passed / failed / errors / skipped counts and the failed tests' names (None
    when pytest wrote no report: it was killed, or never started)."""
    if not path.is_file() or path.stat().st_size == 0:
        return None
    root = ET.parse(path).getroot()
    cases = list(root.iter("testcase"))
    failed = [c for c in cases if c.find("failure") is not None]
    errors = [c for c in cases if c.find("error") is not None]
    skipped = [c for c in cases if c.find("skipped") is not None]
    return {
        "passed": len(cases) - len(failed) - len(errors) - len(skipped),
        "failed": len(failed),
        "errors": len(errors),
        "skipped": len(skipped),
        "failures": [f"{c.get('classname')}::{c.get('name')}" for c in failed + errors],
    }


def progress_counts(output: str) -> dict[str, Any]:
    """The counts from ``-q``'s progress lines (``..sF  [ 40%]``): what a killed run
    had done."""
    marks = "".join(
        line.split("[")[0].strip()
        for line in output.splitlines()
        if line.rstrip().endswith("%]") and set(line.split("[")[0].strip()) <= set(".sFEx")
    )
    return {
        "passed": marks.count("."),
        "failed": marks.count("F"),
        "errors": marks.count("E"),
        "skipped": marks.count("s") + marks.count("x"),
        "failures": [],
        "counts_from": "progress lines (no JUnit report)",
    }


def run(section: Any, profile: Profile) -> None:
    with tempfile.TemporaryDirectory(prefix="device-correctness-") as tmp:
        pytest = PytestRun(Path(tmp) / "junit.xml")
        try:
            for family in families.FAMILIES:
                section.item(
                    family, lambda f=family: families.check_family(f, profile, f"{tmp}/xla")
                )
            limit = profile.pytest_timeout_s - (time.perf_counter() - pytest.start)
            section.item("pytest_gpu", lambda: pytest.result(limit))
        finally:
            pytest.stop()
