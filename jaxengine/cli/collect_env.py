"""`jaxengine collect-env`: the environment report to paste into a bug report.

Prints the system (OS, Python, CPU, memory), the versions of jaxengine and the packages
it runs on (jax, jaxlib and any installed jax plugin such as ``jax-cuda12-plugin`` or
``libtpu``, flax, transformers, ...), the JAX backend and its devices, and the relevant
environment variables (``JAX_*``, ``XLA_*``, ``TPU_*``, ``HF_*``, ``JAXENGINE_*``,
``CUDA_VISIBLE_DEVICES``), with the values of names holding KEY, TOKEN, SECRET or
PASSWORD masked.

Every probe is guarded: one that fails prints ``unavailable (reason)`` and the report
goes on. jax is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = (
    "jax",
    "jaxlib",
    "flax",
    "transformers",
    "tokenizers",
    "torch",
    "numpy",
    "fastapi",
    "uvicorn",
    "openai",
)
"""Distributions whose versions are reported, after jaxengine's own."""
PLUGIN_PREFIXES = ("jax-cuda", "jax-rocm", "libtpu")
"""Normalized distribution-name prefixes of JAX's accelerator plugins."""
ENV_PREFIXES = ("JAX_", "XLA_", "TPU_", "JAXENGINE_", "HF_")
ENV_NAMES = ("CUDA_VISIBLE_DEVICES",)
SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD")

Section = list[tuple[str, str]]


def register(subparsers) -> None:
    """Adds the ``collect-env`` subcommand."""
    parser = subparsers.add_parser(
        "collect-env",
        help="print environment information for bug reports",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Prints the report; returns 0 (failed probes are reported, not raised)."""
    sections = [
        ("System", system_info()),
        ("Python packages", package_versions()),
        ("JAX backend", jax_info()),
        ("Environment variables", env_vars(os.environ)),
    ]
    print(format_report(sections))
    return 0


def probe(fn: Callable[[], Any]) -> str:
    """``str(fn())``, or ``unavailable (reason)`` when it raises."""
    try:
        return str(fn())
    except Exception as e:  # noqa: BLE001 - a report must never crash
        return f"unavailable ({type(e).__name__}: {e})"


def format_report(sections: list[tuple[str, Section]]) -> str:
    """Titled sections of ``name: value`` lines, names aligned."""
    lines: list[str] = []
    for title, rows in sections:
        lines += ["=" * 40, title.center(40).rstrip(), "=" * 40]
        width = max((len(name) for name, _ in rows), default=0)
        lines += [f"{name + ':':<{width + 1}} {value}" for name, value in rows]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


# --------------------------------------------------------------------------- system


def system_info() -> Section:
    return [
        ("OS", probe(_os_name)),
        ("Python", f"{platform.python_version()} ({sys.executable})"),
        ("CPU", probe(_cpu_model)),
        ("CPU count", probe(_cpu_count)),
        ("Total RAM", probe(_total_ram)),
        ("GPU (nvidia-smi)", probe(_nvidia_smi)),
    ]


def _os_name() -> str:
    name = platform.platform()
    try:
        pretty = platform.freedesktop_os_release().get("PRETTY_NAME")
    except OSError:
        pretty = None
    return f"{pretty} ({name})" if pretty else name


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _cpu_count() -> str:
    logical = os.cpu_count()
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return f"{logical} logical"
    return f"{logical} logical, {usable} usable by this process"


def _total_ram() -> str:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return f"{total / 2**30:.1f} GiB"


def _nvidia_smi() -> str:
    if shutil.which("nvidia-smi") is None:
        return "not found"
    query = "--query-gpu=name,driver_version,memory.total"
    out = subprocess.run(
        ["nvidia-smi", query, "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=20,
        check=True,
    )
    return "; ".join(line.strip() for line in out.stdout.splitlines() if line.strip())


# --------------------------------------------------------------------------- packages


def package_versions() -> Section:
    rows = [("jaxengine", probe(_jaxengine_version))]
    rows += [(name, version_of(name)) for name in PACKAGES[:2]]
    rows.append(("jax plugins", probe(_jax_plugins)))
    rows += [(name, version_of(name)) for name in PACKAGES[2:]]
    return rows


def version_of(dist: str) -> str:
    """The installed version of distribution ``dist``, or ``not installed``."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"
    except Exception as e:  # noqa: BLE001 - broken metadata must not end the report
        return f"unavailable ({type(e).__name__}: {e})"


def _jaxengine_version() -> str:
    from jaxengine.version import __version__

    return __version__


def _jax_plugins() -> str:
    found = set()
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith(PLUGIN_PREFIXES):
            found.add(f"{name} {dist.version}")
    return ", ".join(sorted(found)) or "none"


# --------------------------------------------------------------------------- jax


def jax_info() -> Section:
    """Backend and devices; jax is imported (and its backend started) here."""
    try:
        import jax
    except Exception as e:  # noqa: BLE001
        return [("jax", f"unavailable ({type(e).__name__}: {e})")]
    return [
        ("jax.__version__", probe(lambda: jax.__version__)),
        ("Default backend", probe(jax.default_backend)),
        ("Devices", probe(lambda: describe_devices(jax.devices()))),
        ("Device memory", probe(lambda: describe_memory(jax.devices()))),
        ("Process count", probe(jax.process_count)),
    ]


def describe_devices(devices: list[Any]) -> str:
    """``"8 x TPU v5 lite (tpu)"``: device kinds with their counts."""
    kinds = Counter(f"{d.device_kind} ({d.platform})" for d in devices)
    return ", ".join(f"{n} x {kind}" for kind, n in kinds.items())


def describe_memory(devices: list[Any]) -> str:
    """Memory limit of each device where ``memory_stats()`` reports ``bytes_limit``."""
    parts = []
    for d in devices:
        stats = d.memory_stats()
        limit = stats.get("bytes_limit") if stats else None
        if limit is not None:
            parts.append(f"{d.id}: {limit / 2**30:.1f} GiB")
    return ", ".join(parts) or "not reported by the backend"


# --------------------------------------------------------------------------- environment


def env_vars(environ: Mapping[str, str]) -> Section:
    """The relevant variables of ``environ``, sorted, secrets masked."""
    names = sorted(n for n in environ if n.startswith(ENV_PREFIXES) or n in ENV_NAMES)
    rows = [(name, mask(name, environ[name])) for name in names]
    return rows or [("(none set)", "-")]


def mask(name: str, value: str) -> str:
    """``***`` for a variable whose name suggests a secret, else the value itself."""
    return "***" if any(m in name.upper() for m in SECRET_MARKERS) else value
