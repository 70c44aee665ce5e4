"""The head <-> headless-node protocol of multi-node data parallelism, without a model.

A `DPHead` and a `NodeServer` (on a thread, with fake replicas in place of
`AsyncLLM`s) talk over a real local socket: registration and refusals, outputs,
per-request errors, stats, aborts, the head closing the node, and a node that
disappears mid-request. The end-to-end run with real engines is
tests/server/test_dp_multinode.py.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from multiprocessing.connection import Client

import pytest

from jaxengine.config import ParallelConfig
from jaxengine.entrypoints.client import EngineDeadError
from jaxengine.entrypoints.dp_head import DPHead, DPRegistrationError
from jaxengine.entrypoints.dp_node import NodeServer, Outbox, connect_to_head, register
from jaxengine.entrypoints.dp_remote import authkey, recv, send
from jaxengine.entrypoints.streams import Load, StreamTable
from jaxengine.inputs import PreparedPrompt
from jaxengine.messages import PROTOCOL_VERSION, NodeInfo, Refused, Register
from jaxengine.metrics.stats import IterationStats
from jaxengine.outputs import CompletionOutput, RequestOutput
from jaxengine.sampling_params import SamplingParams

MAX_MODEL_LEN, VOCAB = 128, 256
FAIL, HANG = 666, 777  # first prompt tokens that make a fake replica fail / never finish


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parallel(size: int = 3, local: int = 1, **kwargs) -> ParallelConfig:
    return ParallelConfig(
        data_parallel_size=size,
        data_parallel_size_local=local,
        data_parallel_address="127.0.0.1",
        data_parallel_rpc_port=free_port(),
        **kwargs,
    )


class FakeReplica:
    """`AsyncLLM.generate` of a model that echoes the prompt, one token per output."""

    errored = False

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.cancelled: list[str] = []
        self.stat_logger = None  # what a real replica's engine thread reports to

    async def generate(self, prepared, params, request_id, *, priority=0):
        if prepared.token_ids[0] == FAIL:
            raise RuntimeError(f"sampling failed on rank {self.rank}")
        for i, token in enumerate(prepared.token_ids):
            try:
                await asyncio.sleep(3600 if token == HANG else 0)
            except asyncio.CancelledError:
                self.cancelled.append(request_id)
                raise
            done = i == len(prepared.token_ids) - 1
            reason = "length" if done else None
            seq = CompletionOutput(0, "", [token + self.rank], None, None, reason)
            first = [request_id] if i == 0 else []  # its sequence's first token
            self.stat_logger.record(
                f"sched-{self.rank}", IterationStats(prefilled_request_ids=first)
            )
            yield RequestOutput(request_id, None, prepared.token_ids, None, [seq], done)


class FakeNode:
    """A headless node on a thread: registers ``ranks`` and serves fake replicas."""

    def __init__(self, config: ParallelConfig, ranks: tuple[int, ...], **info) -> None:
        fields = dict(data_parallel_size=config.data_parallel_size, max_model_len=MAX_MODEL_LEN)
        fields |= dict(vocab_size=VOCAB, host="fake") | info
        self.conn = connect_to_head(config.data_parallel_rpc_address, timeout=10)
        self.info = NodeInfo(ranks, **fields)
        self.replicas = {rank: FakeReplica(rank) for rank in ranks}
        self.refusal: str | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.refusal = register(self.conn, self.info)
        if self.refusal is not None:
            return
        outbox = Outbox(self.conn)
        for rank, replica in self.replicas.items():
            replica.stat_logger = outbox.stats_logger(rank)
        asyncio.run(NodeServer(self.conn, self.replicas, outbox).run())
        outbox.close()
        self.conn.close()


class Recorder:
    def __init__(self) -> None:
        self.records: list[tuple] = []

    def record(self, scheduler_stats, iteration_stats) -> None:
        self.records.append((scheduler_stats, iteration_stats))


def prepared(*tokens: int) -> PreparedPrompt:
    return PreparedPrompt(None, list(tokens), SamplingParams(max_tokens=len(tokens)))


async def collect(replica, prompt: PreparedPrompt, request_id: str) -> list[int]:
    outs = [out async for out in replica.generate(prompt, prompt.params, request_id)]
    return [t for out in outs for t in out.outputs[0].token_ids]


def test_requests_errors_stats_and_close():
    config = parallel(size=3, local=1)
    head = DPHead(config)
    node = FakeNode(config, (1, 2))
    table = StreamTable()
    replicas = head.wait(MAX_MODEL_LEN, VOCAB, timeout=10, streams=table)
    assert [r.rank for r in replicas] == [1, 2]
    assert all(r.streams is table for r in replicas)
    recorders = [Recorder(), Recorder()]
    for replica, recorder in zip(replicas, recorders, strict=True):
        replica.stat_loggers = [recorder]

    async def main():
        one, two = replicas
        tokens = await asyncio.gather(
            collect(one, prepared(10, 11, 12), "a"), collect(two, prepared(20, 21), "b")
        )
        assert tokens == [[11, 12, 13], [22, 23]]
        with pytest.raises(RuntimeError, match="sampling failed on rank 2"):
            await collect(two, prepared(FAIL, 1), "bad")
        await two.check_health()  # one failed request leaves the replica healthy
        assert await collect(two, prepared(5), "after") == [7]
        stream = one.generate(prepared(1, HANG), None, "hang")
        await anext(stream)
        assert one.num_requests() == 1 and two.num_requests() == 0
        assert table.load() == Load(1, 0)  # its first token, reported with the stats
        assert table.owner_of("hang") == 1 and table.counts() == {1: 1}
        await stream.aclose()  # aborts it on the node
        assert one.num_requests() == 0 and table.count() == 0
        for _ in range(100):
            if node.replicas[1].cancelled:
                break
            await asyncio.sleep(0.05)
        assert node.replicas[1].cancelled == ["hang"]

    asyncio.run(asyncio.wait_for(main(), timeout=30))
    (sched, first), *_ = recorders[0].records
    assert (sched, first.prefilled_request_ids) == ("sched-1", ["a"])
    (sched, first), *_ = recorders[1].records
    assert (sched, first.prefilled_request_ids) == ("sched-2", ["b"])
    replicas[0].shutdown()  # closes the node, once for both replicas
    node.thread.join(10)
    assert not node.thread.is_alive()


def test_a_lost_node_fails_its_streams_and_health():
    config = parallel(size=2, local=1)
    head = DPHead(config)
    node = FakeNode(config, (1,))
    (replica,) = head.wait(MAX_MODEL_LEN, VOCAB, timeout=10)

    async def main():
        stream = replica.generate(prepared(1, HANG), None, "victim")
        await anext(stream)
        # the node dies mid-request: its socket closes
        socket.socket(fileno=os.dup(node.conn.fileno())).shutdown(socket.SHUT_RDWR)
        with pytest.raises(EngineDeadError, match="rank 1"):
            await anext(stream)
        with pytest.raises(EngineDeadError):
            await replica.check_health()
        with pytest.raises(EngineDeadError):
            await collect(replica, prepared(1), "late")

    asyncio.run(asyncio.wait_for(main(), timeout=30))
    assert replica.errored and not replica.is_running
    replica.shutdown()


def test_wrong_ranks_are_refused_and_missing_ranks_time_out():
    config = parallel(size=3, local=1)
    head = DPHead(config)
    theirs = FakeNode(config, (0,))  # the head's own rank
    other_size = FakeNode(config, (1,), data_parallel_size=4)
    for node in (theirs, other_size):
        node.thread.join(10)
    assert "not remote ranks" in theirs.refusal
    assert "--data-parallel-size is 4" in other_size.refusal
    FakeNode(config, (1,))
    with pytest.raises(DPRegistrationError, match=r"ranks \[2\] did not register"):
        head.wait(MAX_MODEL_LEN, VOCAB, timeout=1)


def test_a_node_of_another_protocol_version_is_refused():
    config = parallel(size=2, local=1)
    head = DPHead(config)
    conn = connect_to_head(config.data_parallel_rpc_address, timeout=10)
    send(conn, Register(NodeInfo((1,), 2, MAX_MODEL_LEN, VOCAB, "old"), PROTOCOL_VERSION + 1))
    reply = recv(conn)
    assert isinstance(reply, Refused)
    assert f"protocol version {PROTOCOL_VERSION + 1}, this process version {PROTOCOL_VERSION}" in (
        reply.reason
    )
    conn.close()
    node = FakeNode(config, (1,))  # the rank is still free for a node of this version
    (replica,) = head.wait(MAX_MODEL_LEN, VOCAB, timeout=10)
    replica.shutdown()
    node.thread.join(10)
    assert node.refusal is None and not node.thread.is_alive()


def test_a_node_with_another_model_is_refused():
    config = parallel(size=2, local=1)
    head = DPHead(config)
    node = FakeNode(config, (1,), max_model_len=64)
    with pytest.raises(DPRegistrationError, match="max_model_len 64"):
        head.wait(MAX_MODEL_LEN, VOCAB, timeout=10)
    node.thread.join(10)
    assert "max_model_len 64" in node.refusal


def test_a_wrong_key_is_refused(monkeypatch):
    config = parallel(size=2, local=1)
    head = DPHead(config)
    monkeypatch.setenv("JAXENGINE_DP_AUTHKEY", "not the head's key")
    with pytest.raises(RuntimeError, match="JAXENGINE_DP_AUTHKEY"):
        connect_to_head(config.data_parallel_rpc_address, timeout=5)
    monkeypatch.delenv("JAXENGINE_DP_AUTHKEY")
    conn = Client(config.data_parallel_rpc_address, authkey=authkey())  # the head still listens
    conn.close()
    head.close()


def _serve_args(argv: list[str]):
    from jaxengine.cli.main import build_parser

    return build_parser(["jaxengine.cli.serve"]).parse_args(["serve", *argv])


def test_headless_needs_nnodes_or_a_data_parallel_address():
    from server.api_server.launch import run_headless

    with pytest.raises(ValueError, match="--headless runs either a follower"):
        run_headless(_serve_args(["--headless"]))


def test_only_headless_nodes_take_a_start_rank():
    from jaxengine.entrypoints.factory import start_dp_head

    node = parallel(size=2, local=1, data_parallel_start_rank=1)
    with pytest.raises(ValueError, match="--data-parallel-start-rank 1 is for --headless"):
        start_dp_head(node)
    assert start_dp_head(ParallelConfig(data_parallel_size=2)) is None


def test_the_offline_engine_refuses_remote_replicas():
    from jaxengine.config import EngineConfig
    from jaxengine.entrypoints.factory import build_engine

    config = EngineConfig(parallel_config=parallel(size=2, local=1))
    with pytest.raises(ValueError, match="only `jaxengine serve`"):
        build_engine(config)
