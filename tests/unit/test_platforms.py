"""`jaxengine.platforms`: the CPU where libtpu is installed but no TPU is (no JAX)."""

from __future__ import annotations

import pytest

from jaxengine import platforms


@pytest.fixture
def machine(monkeypatch):
    """A machine with libtpu installed, whose TPU device files and plugins are set."""
    state = {"chips": False, "installed": {"libtpu"}}
    monkeypatch.setattr(platforms, "has_tpu_chips", lambda: state["chips"])
    monkeypatch.setattr(platforms, "_installed", lambda name: name in state["installed"])
    return state


def test_libtpu_without_chips_means_the_cpu(machine):
    environ: dict = {}
    assert platforms.cpu_unless_a_tpu(environ) and environ == {"JAX_PLATFORMS": "cpu"}


@pytest.mark.parametrize("case", ["chips", "user's choice", "cuda plugin", "no libtpu"])
def test_nothing_changes_otherwise(machine, case):
    environ = {"JAX_PLATFORMS": "tpu"} if case == "user's choice" else {}
    machine["chips"] = case == "chips"
    if case == "cuda plugin":
        machine["installed"].add("jax_cuda13_plugin")
    if case == "no libtpu":
        machine["installed"].clear()
    before = dict(environ)
    assert not platforms.cpu_unless_a_tpu(environ) and environ == before


def test_importing_the_package_starts_jax_quietly_on_the_cpu():
    """``import jaxengine`` before JAX, on this machine (libtpu installed by the test
    extra, no TPU): JAX comes up on the CPU without libtpu's warnings."""
    import os
    import subprocess
    import sys

    if not platforms._installed("libtpu") or platforms.has_tpu_chips():
        pytest.skip("needs libtpu installed and no TPU")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    code = "import jaxengine, jax; print(jax.devices()[0].platform)"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "cpu"
    assert "TPU_WORKER_HOSTNAMES" not in done.stderr and "libtpu" not in done.stderr
