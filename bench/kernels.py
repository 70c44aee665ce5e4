"""Attention kernels side by side: time, achieved bandwidth, fraction of copy bandwidth.

Two workloads in the Llama-3-8B head layout (32 query heads, 8 KV heads, head dim
128), bfloat16, pages of 16 tokens scattered over the cache:

- ``decode``: 64 requests, one new token each, KV length 2048;
- ``mixed``: 60 decodes at KV length 2048 plus 4 prefill chunks of 128 new tokens
  over 1024 cached ones (572 tokens), as the engine batches them.

``--smollm2`` swaps in SmolLM2-135M's layout (9 query heads, 3 KV heads, head dim
64), the CPU engine's default model: ``decode`` (64 requests x 1 token over 128-256
cached tokens), ``prefill`` (one chunk of 512 tokens) and ``mixed`` (56 of those
decodes plus two chunks of 100 tokens over 64 cached).

Peers on the same data, in one run:

- ``pallas``: this platform's Pallas kernel (TPU: Mosaic, GPU: Triton; on CPU only
  with ``--interpret``, and then only to check the script);
- ``reference``: the pure-JAX reference (XLA);
- ``xla-cpu`` (on CPU): the request-major CPU path, `ragged_paged_attention.cpu`;
- ``dot_product_attention``: ``jax.nn.dot_product_attention`` on the same K and V
  gathered into dense ``[R, L, Hkv, D]`` arrays beforehand (gathering not timed),
  queries padded to ``[R, Q, Hq, D]`` with a mask; on GPU also with
  ``implementation="cudnn"`` when cuDNN takes the shapes.

Bytes are what the batch needs (`cost.batch_cost`: each request's K and V once, plus
queries and outputs), the same count for every peer, so "GB/s" is effective bandwidth.
"copy" is the device's measured copy bandwidth (read + write of a 1 GiB elementwise
pass); "of copy" is the peer's GB/s over it: the decode target for the kernel is 70%.

    python -m bench.kernels                 # on a GPU or TPU machine
    python -m bench.kernels --small --interpret   # a tiny check on CPU
    python -m bench.kernels --smollm2 --dtype float32   # the CPU engine's shapes
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.benchmarks.common import describe_run, fmt, format_table, log, machine_info
from jaxengine.runner.attention_backend import select_attention_backend
from pallas_kernels.ragged_paged_attention import cpu, reference
from pallas_kernels.ragged_paged_attention.cost import Cost, batch_cost


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    q_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16


def workloads(small: bool, smollm2: bool = False) -> list[Workload]:
    if smollm2:
        return smollm2_workloads()
    if small:
        tiny = dict(num_q_heads=4, num_kv_heads=2, head_dim=64)
        return [
            Workload("decode", (1,) * 4, (64,) * 4, **tiny),
            Workload("mixed", (1, 1, 16), (64, 64, 48), **tiny),
        ]
    return [
        Workload("decode", (1,) * 64, (2048,) * 64),
        Workload("mixed", (1,) * 60 + (128,) * 4, (2048,) * 60 + (1152,) * 4),
    ]


def smollm2_workloads() -> list[Workload]:
    heads = dict(num_q_heads=9, num_kv_heads=3, head_dim=64)
    ctx = tuple(int(n) for n in np.random.default_rng(1).integers(128, 257, 64))
    return [
        Workload("decode", (1,) * 64, tuple(n + 1 for n in ctx), **heads),
        Workload("prefill", (512,), (512,), **heads),
        Workload(
            "mixed", (1,) * 56 + (100, 100), tuple(n + 1 for n in ctx[:56]) + (164, 164), **heads
        ),
    ]


@dataclasses.dataclass
class Arrays:
    paged: tuple  # the kernels' positional arguments
    dense_q: jax.Array | None  # [R, Q, Hq, D] (None: not built)
    dense_k: jax.Array | None  # [R, L, Hkv, D]
    dense_v: jax.Array | None
    mask: jax.Array | None  # [R, 1, Q, L]
    sm_scale: float


def make_arrays(w: Workload, dtype, seed: int = 0, dense: bool = True) -> Arrays:
    """The paged batch of ``w`` (random queries and cache, pages scattered) and, with
    ``dense``, the same K and V gathered for ``jax.nn.dot_product_attention``."""
    rng = np.random.default_rng(seed)
    s, d = w.page_size, w.head_dim
    pages = [-(-n // s) for n in w.seq_lens]
    num_pages = 1 + sum(pages)
    perm = rng.permutation(np.arange(1, num_pages))
    table = np.zeros((len(pages), max(pages)), np.int32)
    start = 0
    for r, n in enumerate(pages):
        table[r, :n] = perm[start : start + n]
        start += n
    qsl = np.concatenate([[0], np.cumsum(w.q_lens)]).astype(np.int32)
    num_tokens = int(qsl[-1])
    key = jax.random.key(seed)
    kq, kc = jax.random.split(key)
    q = jax.random.normal(kq, (num_tokens, w.num_q_heads, d), dtype)
    cache = jax.random.normal(kc, (num_pages, s, 2 * w.num_kv_heads, d), dtype)
    paged = (
        q,
        cache,
        jnp.asarray(w.seq_lens, jnp.int32),
        jnp.asarray(table),
        jnp.asarray(qsl),
        jnp.asarray(len(w.q_lens), jnp.int32),
    )
    if not dense:
        return Arrays(paged, None, None, None, None, d**-0.5)
    # dense copies for jax.nn.dot_product_attention (built once, not timed)
    longest, widest = max(w.seq_lens), max(w.q_lens)
    kv = cache[jnp.asarray(table)].reshape(len(pages), -1, 2 * w.num_kv_heads, d)[:, :longest]
    q_rows = np.zeros((len(pages), widest), np.int32)
    mask = np.zeros((len(pages), 1, widest, longest), bool)
    for r, (ql, sl) in enumerate(zip(w.q_lens, w.seq_lens, strict=True)):
        q_rows[r, :ql] = np.arange(qsl[r], qsl[r] + ql)
        pos = np.arange(sl - ql, sl)
        mask[r, 0, :ql] = np.arange(longest)[None, :] <= pos[:, None]
    return Arrays(
        paged, q[jnp.asarray(q_rows)], kv[:, :, 0::2], kv[:, :, 1::2], jnp.asarray(mask), d**-0.5
    )


def time_call(fn: Callable, args: tuple, iters: int) -> float:
    """Median seconds per call after one warm-up call (which compiles)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(dtype, iters: int, nbytes: int) -> float:
    """Bytes per second of an elementwise pass (read + write) over ``nbytes``."""
    x = jnp.ones((nbytes // jnp.dtype(dtype).itemsize,), dtype)
    seconds = time_call(jax.jit(lambda a: a + 1), (x,), iters)
    return 2 * nbytes / seconds


def peers(args: argparse.Namespace) -> dict[str, Callable[[Arrays], tuple[Callable, tuple]]]:
    platform = jax.default_backend()
    out = {}
    if platform in ("tpu", "gpu") or args.interpret:
        attention = select_attention_backend("pallas", platform).attention_fn
        out["pallas"] = lambda a: (
            jax.jit(functools.partial(attention, sm_scale=a.sm_scale)),
            a.paged,
        )
    out["reference"] = lambda a: (
        jax.jit(functools.partial(reference.ragged_paged_attention, sm_scale=a.sm_scale)),
        a.paged,
    )
    if platform == "cpu":
        out["xla-cpu"] = lambda a: (
            jax.jit(functools.partial(cpu.ragged_paged_attention, sm_scale=a.sm_scale)),
            a.paged,
        )
    impls = [None, "cudnn"] if platform == "gpu" else [None]
    for impl in impls:
        name = "dot_product_attention" + (f"[{impl}]" if impl else "")
        out[name] = functools.partial(_dense, impl=impl)
    return out


def _reference_output(a: Arrays) -> np.ndarray:
    out = reference.ragged_paged_attention(*a.paged, sm_scale=a.sm_scale)
    return np.asarray(out, np.float32)


def workload_cost(w: Workload, dtype) -> Cost:
    """What the batch needs (`cost.batch_cost`): the same count for every peer."""
    return batch_cost(
        w.seq_lens,
        w.q_lens,
        num_q_heads=w.num_q_heads,
        num_kv_heads=w.num_kv_heads,
        head_dim=w.head_dim,
        itemsize=jnp.dtype(dtype).itemsize,
    )


@dataclasses.dataclass(frozen=True)
class Timing:
    """One peer on one workload: median seconds per call and the rates they give."""

    seconds: float
    bytes_per_s: float  # effective: the batch's needed bytes over the time
    flops_per_s: float


def time_attention(fn: Callable, fn_args: tuple, cost: Cost, iters: int) -> Timing:
    """Times ``fn(*fn_args)`` (`time_call`) and divides ``cost`` by the median."""
    seconds = time_call(fn, fn_args, iters=iters)
    return Timing(seconds, cost.bytes_accessed / seconds, cost.flops / seconds)


def _dense(a: Arrays, impl):
    fn = functools.partial(jax.nn.dot_product_attention, scale=a.sm_scale, implementation=impl)
    return jax.jit(lambda q, k, v, m: fn(q, k, v, mask=m)), (
        a.dense_q,
        a.dense_k,
        a.dense_v,
        a.mask,
    )


def run(args: argparse.Namespace) -> str:
    dtype = jnp.dtype(args.dtype)
    copy_bw = copy_bandwidth(dtype, args.iters, args.copy_mib << 20)
    log(f"copy bandwidth {copy_bw / 1e9:.1f} GB/s")
    rows = []
    for w in workloads(args.small, args.smollm2):
        arrays = make_arrays(w, dtype)
        cost = workload_cost(w, dtype)
        want = None
        for name, build in peers(args).items():
            log(f"{w.name}: {name}")
            try:
                fn, fn_args = build(arrays)
                timing = time_attention(fn, fn_args, cost, args.iters)
            except Exception as exc:  # a peer that cannot take the shapes
                rows.append([w.name, name, "-", "-", "-", "-", f"error: {exc}".splitlines()[0]])
                continue
            note = ""
            if fn_args is arrays.paged:  # same output layout: check against the reference
                got = np.asarray(fn(*fn_args), np.float32)
                want = want if want is not None else _reference_output(arrays)
                note = f"max |err| vs reference {np.abs(got - want).max():.1e}"
            rows.append(
                [
                    w.name,
                    name,
                    fmt(timing.seconds * 1e6, 1),
                    fmt(timing.bytes_per_s / 1e9, 1),
                    f"{100 * timing.bytes_per_s / copy_bw:.0f}%",
                    fmt(timing.flops_per_s / 1e12, 2),
                    note,
                ]
            )
    header = ["workload", "peer", "time us", "GB/s", "of copy", "TFLOP/s", "notes"]
    workload = {
        "dtype": dtype.name,
        "layout": layout_name(args),
        "copy_GBps": round(copy_bw / 1e9, 1),
        "device": jax.devices()[0].device_kind,
    }
    title = "attention kernels"
    return describe_run(title, machine_info(), workload) + "\n" + format_table(header, rows)


def layout_name(args: argparse.Namespace) -> str:
    if args.smollm2:
        return "Hq9/Hkv3/D64, page 16 (SmolLM2-135M)"
    return "small" if args.small else "Hq32/Hkv8/D128, page 16"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--iters", type=int, default=20, help="timed calls per peer (median)")
    parser.add_argument("--copy-mib", type=int, default=1024, help="size of the copy probe")
    parser.add_argument("--small", action="store_true", help="tiny shapes (a CPU check)")
    parser.add_argument("--smollm2", action="store_true", help="SmolLM2-135M's head layout")
    parser.add_argument(
        "--interpret", action="store_true", help="run the Pallas kernel in interpret mode on CPU"
    )
    print(run(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
