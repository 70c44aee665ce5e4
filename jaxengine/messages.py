"""Every message that crosses a process or host boundary, as a frozen dataclass.

A leaf module: it imports only the standard library (and cloudpickle, lazily), so
both ends of every channel can import it without pulling in the engine or JAX.

Two channels use it, both `multiprocessing.connection` sockets carrying `dumps`
bytes:

Multi-host executor (one engine over several hosts; `jaxengine.executor`)::

    follower -> driver: FollowerHello(node_rank, version)        (first message)
    driver -> follower: DriverWelcome(config) | Refused(reason)
    driver -> follower: Warmup(progress) | ExecuteStep(scheduler_output) | Shutdown()

Data-parallel head and headless nodes (`entrypoints.dp_head`, `dp_node`, `dp_remote`)::

    node -> head: Register(info, version)                        (first message)
    head -> node: Ready() | Refused(reason)
    head -> node: AddRequest(rank, request_id, prompt, priority)
                  | AbortRequests(rank, request_ids) | Close()
    node -> head: Batch(items), each item an Output | RequestError | Stats | Dead

The side that accepts a connection checks the first message's ``version`` with
`check_version` and answers `Refused` (naming both versions) when they differ.
Bump `PROTOCOL_VERSION` whenever a message here changes shape.

Messages are pickles, so a peer that can send them can run code on the receiver:
the sockets are authenticated and must only be reachable from trusted hosts.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxengine.outputs import RequestOutput

PROTOCOL_VERSION = 5  # 5: PreparedPrompt carries its images (mm_items)
"""The wire format's version; both ends of a connection must agree on it."""


class ProtocolMismatchError(RuntimeError):
    """The peer speaks another `PROTOCOL_VERSION` (a different jaxengine build)."""


def check_version(peer_version: int, peer: str) -> None:
    """Raises `ProtocolMismatchError` naming both versions when ``peer_version``
    differs from this build's `PROTOCOL_VERSION`; ``peer`` names the other side."""
    if peer_version != PROTOCOL_VERSION:
        raise ProtocolMismatchError(
            f"{peer} speaks jaxengine protocol version {peer_version}, this process "
            f"version {PROTOCOL_VERSION}: run the same jaxengine version on every node"
        )


# ---------------------------------------------------------------------- both channels


@dataclasses.dataclass(frozen=True)
class Refused:
    """The connection is refused (either side), e.g. a version or configuration
    mismatch; the sender closes the connection after it."""

    reason: str


# ---------------------------------------------------------------------- multi-host executor


@dataclasses.dataclass(frozen=True)
class FollowerHello:
    """Follower -> driver, the first message: which node this is."""

    node_rank: int
    version: int = PROTOCOL_VERSION


@dataclasses.dataclass(frozen=True)
class DriverWelcome:
    """Driver -> follower: the driver's `EngineConfig`, which the follower builds."""

    config: object


@dataclasses.dataclass(frozen=True)
class Warmup:
    """Driver -> follower: compile every shape (``progress``: show a progress bar)."""

    progress: bool


@dataclasses.dataclass(frozen=True)
class ExecuteStep:
    """Driver -> follower: run this `SchedulerOutput`, as the driver does."""

    scheduler_output: object


@dataclasses.dataclass(frozen=True)
class Shutdown:
    """Driver -> follower: stop following and release the runner."""


ExecutorMessage = FollowerHello | DriverWelcome | Refused | Warmup | ExecuteStep | Shutdown


# ---------------------------------------------------------------------- data parallel


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """What a headless data-parallel node tells the head when it registers."""

    ranks: tuple[int, ...]
    data_parallel_size: int
    max_model_len: int
    vocab_size: int
    host: str


@dataclasses.dataclass(frozen=True)
class Register:
    """Node -> head, the first message: the node's ranks and model limits."""

    info: NodeInfo
    version: int = PROTOCOL_VERSION


@dataclasses.dataclass(frozen=True)
class Ready:
    """Head -> node: every rank registered; requests follow."""


@dataclasses.dataclass(frozen=True)
class AddRequest:
    """Head -> node: run a request on rank ``rank``. ``prompt`` is a `PreparedPrompt`
    (tokenized and validated on the head; its ``params`` are the sampling params)."""

    rank: int
    request_id: str
    prompt: object
    priority: int = 0


@dataclasses.dataclass(frozen=True)
class AbortRequests:
    """Head -> node: abort these requests on rank ``rank`` (unknown ids are ignored)."""

    rank: int
    request_ids: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Close:
    """Head -> node: stop serving; the node closes its end once it has stopped."""


@dataclasses.dataclass(frozen=True)
class Output:
    """Node -> head (in a `Batch`): one `RequestOutput` of a request on ``rank``."""

    rank: int
    output: RequestOutput


@dataclasses.dataclass(frozen=True)
class RequestError:
    """Node -> head (in a `Batch`): the error that ended one request (it pickles)."""

    rank: int
    request_id: str
    error: BaseException


@dataclasses.dataclass(frozen=True)
class Stats:
    """Node -> head (in a `Batch`): one step's `SchedulerStats` and `IterationStats`."""

    rank: int
    scheduler_stats: object
    iteration_stats: object


@dataclasses.dataclass(frozen=True)
class Dead:
    """Node -> head (in a `Batch`): rank ``rank``'s engine failed; ``reason`` says how."""

    rank: int
    reason: str


BatchItem = Output | RequestError | Stats | Dead


@dataclasses.dataclass(frozen=True)
class Batch:
    """Node -> head: what the node's replicas produced since the last batch, in order."""

    items: tuple[BatchItem, ...]


# ---------------------------------------------------------------------- encoding


def dumps(message: object) -> bytes:
    """Pickles a message; host callables (logits processors) need cloudpickle.

    Raises ValueError when the message cannot be pickled even by cloudpickle (or
    cloudpickle is missing): that is the request's fault, not the connection's.
    """
    try:
        return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        try:
            import cloudpickle
        except ImportError:
            raise ValueError(
                f"a message could not be sent to the other nodes ({exc}); multi-node "
                "engines need picklable logits_processors (or `pip install cloudpickle`)"
            ) from exc
        try:
            return cloudpickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc2:  # noqa: BLE001 - whatever cloudpickle cannot handle
            raise ValueError(
                f"a message could not be sent to the other nodes ({exc2}); multi-node "
                "engines need picklable logits_processors"
            ) from exc2


def loads(data: bytes) -> object:
    """The message `dumps` encoded (a cloudpickle needs cloudpickle installed here)."""
    return pickle.loads(data)
