"""ParallelConfig: how the model is spread over devices and hosts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jaxengine.config.utils import require, spec, validate_config

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
    """Backend for distributed model workers. "uni" (or unset) runs everything in
    this process; "mp" is the same on one node, and with `--nnodes` N > 1 spans N
    hosts through JAX's multi-controller runtime (one process per node, this one the
    driver when `--node-rank` is 0, the others started with `jaxengine serve
    --headless`); "ray" starts one worker per host slice on a running Ray cluster and
    drives them from this process. "external_launcher" is not supported yet."""
    data_parallel_address: str | None = spec(None, aliases=("-dpa",))
    """Address of the data parallel cluster head node."""
    data_parallel_rpc_port: int | None = spec(None, ge=1, le=65535, aliases=("-dpp",))
    """Port for data parallel RPC communication."""
    max_parallel_loading_workers: int | None = spec(None, ge=1)
    """Maximum number of parallel loading workers when loading the model in
    multiple batches, to avoid running out of host RAM with large models."""
    nnodes: int = spec(1, ge=1, aliases=("-n",))
    """Number of nodes (one JAX process each) that one engine spans with the "mp"
    backend. Every node runs the same command; node 0 serves, the others with
    `--headless`."""
    node_rank: int = spec(0, ge=0, aliases=("-r",))
    """This node's rank among `--nnodes` (0 is the driver, which schedules)."""
    master_addr: str = "127.0.0.1"
    """Address of node 0, where JAX's distributed coordinator runs (multi-node)."""
    master_port: int = spec(29501, ge=1, le=65535)
    """Port of JAX's distributed coordinator on `--master-addr` (multi-node)."""

    def __post_init__(self) -> None:
        validate_config(self)
        require(
            self.node_rank < self.nnodes,
            "node_rank",
            f"({self.node_rank}) must be smaller than nnodes ({self.nnodes})",
        )
        require(
            self.nnodes == 1 or self.distributed_executor_backend in (None, "mp"),
            "nnodes",
            f"({self.nnodes}) > 1 needs the mp backend (got "
            f"{self.distributed_executor_backend}); Ray places its workers itself",
        )

    @property
    def world_size(self) -> int:
        """Devices one model replica spans: tensor x pipeline parallel sizes."""
        return self.tensor_parallel_size * self.pipeline_parallel_size
