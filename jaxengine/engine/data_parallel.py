"""Data parallelism: N engine replicas behind the interface of one `LLMEngine`.

``--data-parallel-size N`` splits the devices into N groups of tensor x pipeline
parallel size (`sharding.mesh.replica_devices`) and builds one `LLMEngine` on each,
with its own scheduler and KV cache. `DataParallelEngine` offers what the offline
`LLM` calls on an engine (`prepare`, `add_prepared`, `step`, `abort_request`,
`has_unfinished_requests`, ...): a new request goes to the replica that
`core.dp_balancer.DPBalancer` picks (least running + waiting, with prefix-cache
affinity), and `step()` steps every busy replica, on a thread each, so the devices
run at the same time (a step blocks on its sampled ids; JAX releases the GIL).

The server does not step this class: it runs one `AsyncLLM` thread per replica
(`entrypoints.dp_async_llm`) and uses `replicas` from here.

With ``--data-parallel-size-local L`` < N (replicas on several nodes) this class
holds this node's L replicas only, on its first L groups of devices; the API server
reaches the others through `entrypoints.dp_remote`. The offline `LLM` cannot.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxengine.config import EngineConfig, ParallelConfig
from jaxengine.core.dp_balancer import DPBalancer
from jaxengine.core.sched_output import SchedulerStats, SpecDecodingStats
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.engine.rollout import RolloutControl
from jaxengine.inputs import PreparedPrompt
from jaxengine.outputs import RequestOutput
from jaxengine.sampling_params import SamplingParams


class DataParallelEngine:
    """``data_parallel_size`` `LLMEngine`s, one per device group, used as one."""

    def __init__(
        self, config: EngineConfig, *, warmup: bool = True, devices: Sequence[Any] | None = None
    ) -> None:
        from sharding.mesh import replica_devices

        groups = replica_devices(local_parallel(config.parallel_config), devices)
        self.replicas = [LLMEngine(config, warmup=False, devices=group) for group in groups]
        if warmup and not config.model_config.enforce_eager:
            for replica in self.replicas:
                replica.executor.warmup()
        first = self.replicas[0]
        self.config = first.config  # max_model_len resolved
        self.tokenizer = first.tokenizer
        self.generation_config = first.generation_config
        self.max_model_len = first.max_model_len
        self.pooler = first.pooler
        self.images = first.images
        self.vocab_size = first.vocab_size
        self.eos_token_id = first.eos_token_id
        self.balancer = DPBalancer(
            len(self.replicas), block_size=self.config.cache_config.block_size
        )
        self._owner: dict[str, int] = {}  # request id -> replica index
        self.rollout = RolloutControl(self.replicas, first._checkpoint_tensors)
        """Sleep mode and weight updates on every replica (`engine.rollout`)."""
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    # ------------------------------------------------------------------ requests

    def tokenize(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        return self.replicas[0].tokenize(prompt)

    def prepare(
        self, prompt: str | list[int] | dict, params: SamplingParams, lora_request: Any = None
    ) -> PreparedPrompt:
        """Tokenizes and validates (every replica runs the same model and limits; the
        others read an adapter when a request of it first runs there)."""
        return self.replicas[0].prepare(prompt, params, lora_request)

    def add_lora(self, lora_request: Any) -> bool:
        """Adds the adapter on every replica; False when each had it already."""
        return any([replica.add_lora(lora_request) for replica in self.replicas])

    def remove_lora(self, lora_id: int) -> bool:
        """Forgets the adapter on every replica; False when none knew it."""
        return any([replica.remove_lora(lora_id) for replica in self.replicas])

    def list_loras(self) -> set[int]:
        return self.replicas[0].list_loras()

    def add_request(
        self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams, **kwargs: Any
    ) -> None:
        self.add_prepared(request_id, self.prepare(prompt, params), **kwargs)

    def add_prepared(
        self,
        request_id: str,
        prepared: PreparedPrompt,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> int:
        """Queues a prepared prompt on the replica the balancer picks; returns its index."""
        if request_id in self._owner:
            raise ValueError(f"duplicate request id {request_id!r}")
        index = self.choose_replica(prepared, self.loads())
        self.replicas[index].add_prepared(
            request_id, prepared, arrival_time=arrival_time, priority=priority
        )
        self._owner[request_id] = index
        return index

    def choose_replica(self, prepared: PreparedPrompt, loads: Sequence[int]) -> int:
        """The balancer's pick for ``prepared`` given each replica's load."""
        return self.balancer.choose(prepared.token_ids, loads)

    def loads(self) -> list[int]:
        """Running + waiting sequences of each replica."""
        return [_load(r.get_stats()) for r in self.replicas]

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Aborts requests in any state on whichever replica holds them."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        by_replica: dict[int, list[str]] = {}
        for rid in ids:
            index = self._owner.pop(rid, None)
            if index is not None:
                by_replica.setdefault(index, []).append(rid)
        for index, rids in by_replica.items():
            self.replicas[index].abort_request(rids)

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    # ------------------------------------------------------------------ step

    def step(self) -> list[RequestOutput]:
        """One step of every replica with work (concurrently); their outputs, in order."""
        busy = [r for r in self.replicas if r.has_unfinished_requests()]
        if len(busy) <= 1:
            results = [r.step() for r in busy]
        else:
            futures = [self._executor().submit(r.step) for r in busy]
            concurrent.futures.wait(futures)  # let every step end before raising
            results = [f.result() for f in futures]
        outputs = [out for result in results for out in result]
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        return outputs

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=self.num_replicas, thread_name_prefix="jaxengine-dp"
            )
        return self._pool

    def get_stats(self) -> SchedulerStats:
        """The replicas' snapshots summed (KV-cache usage averaged, per-adapter counts
        merged, ``max_lora`` the flag every replica has)."""
        stats = [r.get_stats() for r in self.replicas]
        total = {
            field.name: _summed([getattr(s, field.name) for s in stats])
            for field in dataclasses.fields(SchedulerStats)
        }
        total["kv_cache_usage"] /= len(stats)
        total["max_lora"] = stats[0].max_lora
        total["sleep_level"] = max(s.sleep_level for s in stats)
        return SchedulerStats(**total)

    def shutdown(self) -> None:
        """Shuts every replica down (idempotent)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for replica in self.replicas:
            replica.shutdown()


def _load(stats: SchedulerStats) -> int:
    return stats.num_running + stats.num_waiting


def local_parallel(parallel: ParallelConfig) -> ParallelConfig:
    """The parallel config of this node's replicas alone (``data_parallel_size`` =
    ``data_parallel_size_local``), which sizes the device groups."""
    if not parallel.has_remote_replicas:
        return parallel
    return dataclasses.replace(
        parallel,
        data_parallel_size=parallel.local_data_parallel_size,
        data_parallel_size_local=None,
        data_parallel_start_rank=None,
    )


def _summed(values: list) -> Any:
    """The sum of numbers, of ``{name: count}`` dicts key by key, or of
    `SpecDecodingStats` field by field (None: speculative decoding off)."""
    if values[0] is None:
        return None
    if isinstance(values[0], SpecDecodingStats):
        return SpecDecodingStats(
            *(_summed([getattr(v, f.name) for v in values]) for f in dataclasses.fields(values[0]))
        )
    if isinstance(values[0], tuple):  # per-position counts, padded to the longest
        width = max(len(v) for v in values)
        return tuple(sum(v[i] for v in values if i < len(v)) for i in range(width))
    if not isinstance(values[0], dict):
        return sum(values)
    out: dict = {}
    for counts in values:
        for key, n in counts.items():
            out[key] = out.get(key, 0) + n
    return out
