"""Which JAX platform a process means, decided before JAX starts (no JAX here).

With libtpu installed (the ``tpu`` extra, which ``jaxengine tpu-check`` needs) on a
machine without a TPU, JAX still tries the TPU first: libtpu prints a page of
warnings about ``TPU_WORKER_HOSTNAMES`` and takes its process lock, then JAX falls
back to the CPU. `cpu_unless_a_tpu` sets ``JAX_PLATFORMS=cpu`` in that case (unless
the user set it, or a CUDA plugin is installed), so the CLI's commands and the servers
it starts stay quiet and on the CPU that is meant. On a TPU VM nothing changes.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from collections.abc import MutableMapping

_TPU_DEVICE_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*")  # v4/v5e/v6e; v5p and later
_CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin")


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def has_tpu_chips() -> bool:
    """Whether this machine has TPU chips (their device files)."""
    return any(glob.glob(pattern) for pattern in _TPU_DEVICE_FILES)


def cpu_unless_a_tpu(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Sets ``JAX_PLATFORMS=cpu`` where libtpu is installed but no TPU is present and
    no other accelerator plugin is; True when it did."""
    if "JAX_PLATFORMS" in environ or not _installed("libtpu") or has_tpu_chips():
        return False
    if any(_installed(name) for name in _CUDA_PLUGINS):
        return False
    environ["JAX_PLATFORMS"] = "cpu"
    return True
