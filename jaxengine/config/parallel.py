"""ParallelConfig: how the model is spread over devices and hosts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jaxengine.config.utils import require, spec, validate_config

DistributedExecutorBackend = Literal["mp", "ray", "uni", "external_launcher"]
DEFAULT_DP_RPC_PORT = 29550
"""vLLM's default `--data-parallel-rpc-port`."""


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
    data_parallel_size_local: int | None = spec(None, ge=1, aliases=("-dpl",))
    """Number of data parallel replicas that run on this node (default: all of
    `--data-parallel-size`). Fewer puts the other replicas on other nodes: the head
    (which serves the API) holds ranks 0.. and each `--headless` node its own slice
    (`--data-parallel-start-rank`), all reached through `--data-parallel-address`.
    Unlike vLLM, the head needs at least one replica of its own."""
    data_parallel_start_rank: int | None = spec(None, ge=0, aliases=("-dpr",))
    """The first data parallel rank of this node's replicas (default 0: the head).
    A `--headless` node of a multi-node data parallel deployment starts at the rank
    after the replicas of the nodes before it."""
    data_parallel_address: str | None = spec(None, aliases=("-dpa",))
    """Address of the data parallel cluster head node. With
    `--data-parallel-size-local` smaller than `--data-parallel-size`, the head
    listens there for the `--headless` nodes that run the other replicas."""
    data_parallel_rpc_port: int | None = spec(None, ge=1, le=65535, aliases=("-dpp",))
    """Port for data parallel RPC communication: the head listens on
    `--data-parallel-address`:port, the headless nodes connect to it (default
    29550, as vLLM). The channel is authenticated with `$JAXENGINE_DP_AUTHKEY`."""
    max_parallel_loading_workers: int | None = spec(None, ge=1)
    """Maximum number of parallel loading workers when loading the model
    sequentially in multiple batches, to avoid RAM OOM with large models. When set,
    that many threads read the safetensors shards ahead of the transfer to the
    devices, holding at most that many shards in host memory at once. Unset (None):
    shards are memory-mapped and read as each tensor goes to the devices."""
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
        self._check_data_parallel_nodes()
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

    def _check_data_parallel_nodes(self) -> None:
        size, local, start = (
            self.data_parallel_size,
            self.local_data_parallel_size,
            self.data_parallel_rank_start,
        )
        require(
            local <= size,
            "data_parallel_size_local",
            f"({local}) must not exceed data_parallel_size ({size})",
        )
        require(
            start + local <= size,
            "data_parallel_start_rank",
            f"({start}) + data_parallel_size_local ({local}) must not exceed "
            f"data_parallel_size ({size}): this node's ranks would be {start}..{start + local - 1}"
            + ("" if self.data_parallel_size_local else "; set data_parallel_size_local"),
        )
        if local == size:
            return
        require(
            self.data_parallel_address is not None,
            "data_parallel_address",
            f"must be set (the head's address) when data_parallel_size_local ({local}) < "
            f"data_parallel_size ({size}): the other replicas run on other nodes, which "
            "connect to the head there",
        )
        require(
            self.nnodes == 1,
            "nnodes",
            f"({self.nnodes}) > 1 (one engine over several hosts) does not combine with "
            "data parallel replicas on several nodes (data_parallel_size_local) yet",
        )

    @property
    def local_data_parallel_size(self) -> int:
        """Replicas on this node: `data_parallel_size_local`, or every one."""
        if self.data_parallel_size_local is None:
            return self.data_parallel_size
        return self.data_parallel_size_local

    @property
    def data_parallel_rank_start(self) -> int:
        """The data parallel rank of this node's first replica (0 on the head)."""
        return self.data_parallel_start_rank or 0

    @property
    def has_remote_replicas(self) -> bool:
        """Whether some replicas run on other nodes (multi-node data parallelism)."""
        return self.local_data_parallel_size < self.data_parallel_size

    @property
    def data_parallel_rpc_address(self) -> tuple[str, int]:
        """(host, port) where the head listens for the headless data parallel nodes."""
        port = self.data_parallel_rpc_port or DEFAULT_DP_RPC_PORT
        return self.data_parallel_address or "127.0.0.1", port

    @property
    def world_size(self) -> int:
        """Devices one model replica spans: tensor x pipeline parallel sizes."""
        return self.tensor_parallel_size * self.pipeline_parallel_size
