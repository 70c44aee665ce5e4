"""Device meshes from `ParallelConfig`, and the checks that the model fits them.

The global mesh has the axes ``data``, ``pipeline`` and ``tensor`` (``data`` outermost,
so a data-parallel replica is a contiguous block of devices and a tensor group is the
innermost, best-connected one). Each data-parallel replica is its own engine; inside
it, each pipeline stage is a mesh of its own with the ``tensor`` axis only populated
(`stage_mesh`), so stage functions compile against the devices they run on.

Expert parallelism uses the ``tensor`` axis: with ``--enable-expert-parallel`` the
experts of a MoE layer are split over the devices that split the attention heads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxengine.config.parallel import ParallelConfig

AXES = ("data", "pipeline", "tensor")


class ParallelismError(ValueError):
    """The parallel sizes do not fit the devices or the model."""


def _devices(devices: Sequence[Any] | None) -> list[Any]:
    return list(jax.devices() if devices is None else devices)


def check_device_count(parallel: ParallelConfig, num_devices: int) -> None:
    """Raises `ParallelismError` unless dp x pp x tp devices are available."""
    need = parallel.data_parallel_size * parallel.world_size
    if need > num_devices:
        raise ParallelismError(
            f"--data-parallel-size {parallel.data_parallel_size} x --pipeline-parallel-size "
            f"{parallel.pipeline_parallel_size} x --tensor-parallel-size "
            f"{parallel.tensor_parallel_size} needs {need} devices, but {num_devices} are "
            f"available ({jax.default_backend()})"
        )


def _auto_mesh(shape: tuple[int, ...], devices: list[Any]) -> Mesh:
    axis_types = (AxisType.Auto,) * len(AXES)
    try:  # topology-aware order (TPU torus, NVLink islands) where JAX knows one
        return jax.make_mesh(shape, AXES, axis_types=axis_types, devices=devices)
    except (ValueError, NotImplementedError, AssertionError):
        return Mesh(np.asarray(devices, dtype=object).reshape(shape), AXES, axis_types=axis_types)


def build_mesh(parallel: ParallelConfig, devices: Sequence[Any] | None = None) -> Mesh:
    """The ``(data, pipeline, tensor)`` mesh over the first dp x pp x tp devices."""
    devices = _devices(devices)
    check_device_count(parallel, len(devices))
    shape = (
        parallel.data_parallel_size,
        parallel.pipeline_parallel_size,
        parallel.tensor_parallel_size,
    )
    used = devices[: int(np.prod(shape))]
    if len(used) == 1:
        return Mesh(np.asarray(used, dtype=object).reshape(shape), AXES)
    return _auto_mesh(shape, used)


def replica_devices(
    parallel: ParallelConfig, devices: Sequence[Any] | None = None
) -> list[list[Any]]:
    """The devices of each data-parallel replica, in mesh order (pipeline, tensor)."""
    mesh = build_mesh(parallel, devices)
    return [list(mesh.devices[i].reshape(-1)) for i in range(parallel.data_parallel_size)]


def stage_mesh(devices: Sequence[Any]) -> Mesh:
    """A mesh whose ``tensor`` axis is ``devices`` (one pipeline stage of one replica)."""
    grid = np.asarray(list(devices), dtype=object).reshape(1, 1, len(devices))
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def stage_devices(parallel: ParallelConfig, devices: Sequence[Any]) -> list[list[Any]]:
    """A replica's devices split into its pipeline stages (each a tensor group)."""
    devices = list(devices)
    if len(devices) != parallel.world_size:
        raise ParallelismError(
            f"a replica needs --pipeline-parallel-size x --tensor-parallel-size = "
            f"{parallel.world_size} devices, got {len(devices)}"
        )
    tp = parallel.tensor_parallel_size
    return [devices[i : i + tp] for i in range(0, len(devices), tp)]


def check_model_fits(parallel: ParallelConfig, config: Any) -> None:
    """Raises `ParallelismError` naming the model dimension a parallel size does not divide.

    ``config`` is a `TransformerConfig`. Attention heads must divide over the tensor
    size; KV heads must divide it or be divided by it (fewer KV heads than devices are
    replicated); with expert parallelism the experts must divide over it; every
    pipeline stage needs at least one layer.
    """
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    problems = []
    if config.num_heads % tp:
        problems.append(
            f"the model's {config.num_heads} attention heads are not divisible by "
            f"--tensor-parallel-size {tp}"
        )
    hkv = config.num_kv_heads
    if hkv % tp and tp % hkv:
        problems.append(
            f"the model's {hkv} KV heads neither divide nor are divisible by "
            f"--tensor-parallel-size {tp}"
        )
    if parallel.enable_expert_parallel:
        experts = getattr(config, "num_experts", 0) or 0
        if experts == 0:
            problems.append("--enable-expert-parallel needs a mixture-of-experts model")
        elif experts % tp:
            problems.append(
                f"the model's {experts} experts are not divisible by the expert-parallel "
                f"size {tp} (--tensor-parallel-size)"
            )
    if len(config.layers) < pp:
        problems.append(
            f"the model's {len(config.layers)} layers are fewer than "
            f"--pipeline-parallel-size {pp} stages"
        )
    if problems:
        raise ParallelismError("; ".join(problems))


def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous layer ranges per pipeline stage, earlier stages one larger when uneven."""
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges
