"""``jaxengine tpu-check``: the engine ``serve`` would build, compiled for a TPU slice.

No TPU is needed: libtpu describes the slice's devices (`tpu_devices`) and compiles for
them on this machine. `check_engine` builds the engine from the model's config alone
(placed parameter shapes, `worker.target`), sizes its KV cache from the chip's HBM,
compiles every program the engine compiles at start-up through a `CompileRecorder`,
and reads the result into a `report.CheckReport`: whether it fits each chip, what
each program costs, and the audit of the decode steps.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from jaxengine.engine_args import EngineArgs
from jaxengine.hardware import TpuSlice, slice_of
from jaxengine.platforms import has_tpu_chips
from jaxengine.tpu_check.recorder import CompileRecorder, ProgramFailed, one_line
from jaxengine.tpu_check.report import CheckReport, analyse

logger = logging.getLogger(__name__)


class CheckFailed(RuntimeError):
    """The engine does not build or compile for the slice: one line says why."""


def tpu_devices(tpu: TpuSlice) -> list[Any]:
    """The slice's devices as libtpu describes them (no TPU needed; libtpu installed:
    the ``tpu`` extra)."""
    # the check never runs on the chips, so it need not hold libtpu's process lock
    # (a TPU VM's server, or a parallel test, may hold it); off a TPU VM, libtpu has no
    # metadata server to ask for the workers and prints a page of warnings without these
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if not has_tpu_chips():
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", tpu.name.replace("v5e-", "v5litepod-"))
    try:
        from jax.experimental import topologies

        description = topologies.get_topology_desc(
            topology_name=tpu.topology, platform="tpu", **tpu.topology_kwargs()
        )
    except Exception as error:  # noqa: BLE001 - no libtpu, or libtpu refuses the slice
        raise CheckFailed(
            f"cannot describe TPU slice {tpu.name} ({tpu.topology}): {one_line(error)}; "
            'the TPU compiler comes with the tpu extra: pip install "jaxengine[tpu]"'
        ) from error
    return list(description.devices)


def check_config(engine_args: EngineArgs) -> Any:
    """The engine config the check builds (as ``serve`` resolves it on a TPU), with
    the settings that do not change the programs made explicit: no tokenizer (the
    folder may hold only ``config.json``), no compilation cache (the compile times are
    the check's to measure). Refuses what the check does not cover."""
    args = dataclasses.replace(
        engine_args, skip_tokenizer_init=True, enable_compilation_cache=False
    )
    config = args.create_engine_config(platform="tpu")
    refused = [
        flag
        for flag, used in (
            ("--pipeline-parallel-size > 1", config.parallel_config.pipeline_parallel_size > 1),
            ("--speculative-config", config.speculative_config.enabled),
            ("--enable-lora", config.lora_config.enable_lora),
        )
        if used
    ]
    if refused:
        raise CheckFailed(f"tpu-check does not compile the programs of {', '.join(refused)} yet")
    if config.model_config.model_impl == "transformers":
        raise CheckFailed("tpu-check compiles JAX models: --model-impl transformers has none")
    return config


def check_engine(engine_args: EngineArgs, topology: str, progress: bool = True) -> CheckReport:
    """Builds and compiles the engine for ``topology`` (``v6e-8``, ``v5e:2x2``, ...).
    Raises `CheckFailed` with one line naming the problem."""
    from jaxengine.worker.build import build_worker
    from jaxengine.worker.target import CompileTarget
    from sharding.mesh import ParallelismError, replica_devices

    tpu = slice_of(topology)
    config = check_config(engine_args)
    devices = tpu_devices(tpu)
    recorder = CompileRecorder()
    target = CompileTarget(recorder, tpu.chip.hbm_bytes)
    try:
        replica = replica_devices(config.parallel_config, devices)[0]
        runner, host = build_worker(config, replica, target)
        runner.warmup(progress=progress)
    except ProgramFailed as error:
        raise CheckFailed(f"{tpu.name}: {error}") from error
    except (ValueError, ParallelismError, NotImplementedError) as error:
        raise CheckFailed(f"{tpu.name}: {error}") from error
    return analyse(tpu, runner, host, recorder.records)
