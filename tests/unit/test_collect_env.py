"""`jaxengine collect-env`: the report runs, names the versions, masks secrets, never crashes."""

from __future__ import annotations

import platform
import sys
from importlib import metadata
from types import SimpleNamespace

from jaxengine.cli import collect_env
from jaxengine.cli.main import main


def row(report: str, name: str) -> str:
    """The value printed after ``name:`` in the report."""
    [line] = [line for line in report.splitlines() if line.startswith(name + ":")]
    return line.split(":", 1)[1].strip()


def test_report_names_python_jax_and_the_backend(capsys, monkeypatch):
    monkeypatch.setenv("JAXENGINE_TEST_SETTING", "visible-value")
    monkeypatch.setenv("HF_TOKEN", "hf-secret-value")
    monkeypatch.setenv("UNRELATED_VARIABLE", "nope")
    assert main(["collect-env"]) == 0
    out = capsys.readouterr().out
    assert platform.python_version() in out
    assert "jax:" in out and metadata.version("jax") in out
    assert "jaxlib:" in out and metadata.version("jaxlib") in out
    assert "jax plugins:" in out and "Default backend:" in out
    assert "Devices:" in out and "Total RAM:" in out
    assert row(out, "JAXENGINE_TEST_SETTING") == "visible-value"
    assert row(out, "HF_TOKEN") == "***" and "hf-secret-value" not in out
    assert "UNRELATED_VARIABLE" not in out


def test_a_failing_probe_is_reported_not_raised():
    def boom() -> str:
        raise RuntimeError("no luck")

    assert collect_env.probe(boom) == "unavailable (RuntimeError: no luck)"
    assert collect_env.version_of("surely-not-an-installed-dist") == "not installed"


def test_jax_that_cannot_be_imported(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax", None)  # makes `import jax` raise ImportError
    [(name, value)] = collect_env.jax_info()
    assert name == "jax" and value.startswith("unavailable (ModuleNotFoundError")


def test_devices_and_memory():
    def device(i, kind, stats):
        return SimpleNamespace(id=i, device_kind=kind, platform="gpu", memory_stats=lambda: stats)

    devices = [
        device(0, "H100", {"bytes_limit": 80 * 2**30}),
        device(1, "H100", {"bytes_in_use": 1}),  # no limit reported
        device(2, "A100", None),  # no stats at all
    ]
    assert collect_env.describe_devices(devices) == "2 x H100 (gpu), 1 x A100 (gpu)"
    assert collect_env.describe_memory(devices) == "0: 80.0 GiB"
    assert collect_env.describe_memory(devices[1:]) == "not reported by the backend"


def test_environment_filter_and_masking():
    environ = {
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_dump_to=/tmp",
        "TPU_NAME": "v5e",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "JAXENGINE_API_KEY": "k",
        "HF_HUB_OFFLINE": "1",
        "OPENAI_SECRET": "not listed",
        "PATH": "/bin",
    }
    rows = dict(collect_env.env_vars(environ))
    assert rows == {
        "CUDA_VISIBLE_DEVICES": "0,1",
        "HF_HUB_OFFLINE": "1",
        "JAXENGINE_API_KEY": "***",
        "JAX_PLATFORMS": "cpu",
        "TPU_NAME": "v5e",
        "XLA_FLAGS": "--xla_dump_to=/tmp",
    }
    assert collect_env.env_vars({}) == [("(none set)", "-")]
