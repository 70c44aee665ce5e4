"""ParallelConfig: how the model is spread over devices and hosts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jaxengine.config.utils import spec, validate_config

DistributedExecutorBackend = Literal["mp", "ray", "uni", "external_launcher"]


@dataclass(frozen=True)
class ParallelConfig:
    """Configuration for distributed execution."""

    tensor_parallel_size: int = spec(1, ge=1, aliases=("-tp",))
    """Number of tensor parallel groups (the size of the mesh's `tensor` axis)."""
    pipeline_parallel_size: int = spec(1, ge=1, aliases=("-pp",))
    """Number of pipeline parallel groups (the size of the mesh's `pipeline` axis)."""
    data_parallel_size: int = spec(1, ge=1, aliases=("-dp",))
    """Number of data parallel groups. MoE layers are sharded by the product of the
    tensor parallel size and the data parallel size."""
    enable_expert_parallel: bool = False
    """Use expert parallelism instead of tensor parallelism for MoE layers."""
    distributed_executor_backend: DistributedExecutorBackend | None = None
    """Backend for distributed model workers. "uni" runs everything in this
    process (what jaxengine does today); "mp", "ray" and "external_launcher" are
    not supported yet."""
    data_parallel_address: str | None = spec(None, aliases=("-dpa",))
    """Address of the data parallel cluster head node."""
    data_parallel_rpc_port: int | None = spec(None, ge=1, le=65535, aliases=("-dpp",))
    """Port for data parallel RPC communication."""
    max_parallel_loading_workers: int | None = spec(None, ge=1)
    """Maximum number of parallel loading workers when loading the model in
    multiple batches, to avoid running out of host RAM with large models."""

    def __post_init__(self) -> None:
        validate_config(self)

    @property
    def world_size(self) -> int:
        """Devices one model replica spans: tensor x pipeline parallel sizes."""
        return self.tensor_parallel_size * self.pipeline_parallel_size
