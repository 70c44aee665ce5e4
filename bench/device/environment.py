"""The environment section: versions, devices, and the two denominators of the run.

- versions of jax, jaxlib, the accelerator plugin (``jax-cuda13-plugin``,
  ``jax-cuda12-plugin`` or ``libtpu``, whichever is installed) and the libraries the
  engine runs on, from `importlib.metadata` (`jaxengine.cli.collect_env.version_of`);
- the devices: backend, kind, count, each one's ``memory_stats()`` where the
  backend reports them, and ``nvidia-smi``'s line where there is one;
- the device-to-device copy bandwidth (`bench.kernels.copy_bandwidth`: an elementwise
  pass, read + write), the read bandwidth (`read_bandwidth`: a float32 sum over a bf16
  array, reads only: what a batch-1 decode does with its weights) and the bf16 matmul
  rate (`bench.compute_ceiling.dot_timer` on
  one layer's projections of the engine section's model, ``matmul_tokens`` rows),
  all measured here, in the same run as the figures that divide by them;
- the vendor's sheet for the device kind (`jaxengine.hardware.chip_of`: HBM bandwidth,
  dense bf16 and fp8 peaks), None where the kind is not in the table (a CPU).
"""

from __future__ import annotations

import platform
from typing import Any

from bench.device.profile import Profile
from jaxengine.cli.collect_env import system_info, version_of

PACKAGES = ("jax", "jaxlib", "flax", "numpy", "transformers", "torch", "pytest")
PLUGINS = (
    "jax-cuda13-plugin",
    "jax-cuda13-pjrt",
    "jax-cuda12-plugin",
    "jax-cuda12-pjrt",
    "libtpu",
)
MEMORY_KEYS = ("bytes_limit", "bytes_in_use", "peak_bytes_in_use")


def versions() -> dict[str, Any]:
    """Versions of the packages and of every plugin that is installed."""
    from jaxengine.version import __version__

    found = {name: version_of(name) for name in PACKAGES}
    found.update({p: v for p in PLUGINS if (v := version_of(p)) != "not installed"})
    return {"jaxengine": __version__, "python": platform.python_version(), **found}


def devices() -> dict[str, Any]:
    """Backend, device kind and count, and each device's memory where reported."""
    import jax

    devs = jax.devices()
    memory = []
    for d in devs:
        try:
            stats = d.memory_stats() or {}
        except Exception:  # noqa: BLE001 - CPU and some plugins have no stats
            stats = {}
        memory.append({k: int(stats[k]) for k in MEMORY_KEYS if k in stats})
    system = dict(system_info())
    return {
        "backend": jax.default_backend(),
        "kind": devs[0].device_kind,
        "count": len(devs),
        "memory": memory,
        "nvidia_smi": system.get("GPU (nvidia-smi)"),
        "cpu": system.get("CPU"),
    }


def matmul_shapes(profile: Profile, layers: int | None) -> list[tuple[int, int]]:
    """One layer's projections ``(out, in)`` of the engine section's model."""
    from bench.compute_ceiling import projection_shapes
    from bench.decode_roofline import llama_config

    return projection_shapes(llama_config(layers, profile.small_model).to_dict())


def copy_bandwidth(profile: Profile) -> dict[str, Any]:
    import jax.numpy as jnp

    from bench import kernels

    rate = kernels.copy_bandwidth(jnp.bfloat16, profile.iters, profile.copy_mib << 20)
    return {"copy_gb_s": rate / 1e9, "probe_mib": profile.copy_mib}


def read_bandwidth(profile: Profile) -> dict[str, Any]:
    """Bytes per second of a read-only pass: ``jnp.sum`` in float32 over a bf16 array
    of ``read_mib`` (the one float written back is nothing)."""
    import jax
    import jax.numpy as jnp

    from bench.kernels import time_call

    nbytes = profile.read_mib << 20
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    seconds = time_call(jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), (x,), profile.iters)
    return {"read_gb_s": nbytes / seconds / 1e9, "probe_mib": profile.read_mib}


def sheet() -> dict[str, Any] | None:
    """The sheet's figures for this device kind, or None when the table lacks it."""
    import jax

    from jaxengine.hardware import chip_of

    chip = chip_of(jax.devices()[0].device_kind)
    if chip is None:
        return None
    fp8 = chip.fp8_flops / 1e12 if chip.fp8_flops else None
    return {"chip": chip.name, "sheet_gb_s": chip.hbm_bandwidth / 1e9,
            "sheet_bf16_tflop_s": chip.bf16_flops / 1e12, "sheet_fp8_tflop_s": fp8}  # fmt: skip


def matmul_rate(profile: Profile, layers: int | None) -> dict[str, Any]:
    from bench.compute_ceiling import dot_timer

    shapes = matmul_shapes(profile, layers)
    rate = dot_timer(shapes, "bfloat16", profile.matmul_tokens, "bfloat16")(profile.iters)
    return {
        "matmul_tflop_s": rate / 1e12,
        "dtype": "bfloat16",
        "tokens": profile.matmul_tokens,
        "shapes": shapes,
    }


def run(section: Any, profile: Profile, layers: int | None) -> dict[str, float]:
    """Records the section's items; returns the denominators for the later sections
    (``copy_gb_s``, ``read_gb_s``, ``matmul_tflop_s`` and the sheet's ``sheet_gb_s``,
    ``sheet_bf16_tflop_s``; absent when their measurement failed or, for the sheet's,
    where the device kind is not in it)."""
    section.item("versions", versions)
    section.item("devices", devices)
    figures = section.item("sheet", sheet) or {}  # None (recorded as null) on a CPU
    copy = section.item("copy", lambda: copy_bandwidth(profile)) or {}
    read = section.item("read", lambda: read_bandwidth(profile)) or {}
    matmul = section.item("matmul", lambda: matmul_rate(profile, layers)) or {}
    found = {**figures, **copy, **read, **matmul}
    return {k: v for k, v in found.items() if k.endswith(("_gb_s", "_tflop_s")) and v}
