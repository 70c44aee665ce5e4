"""Per-device memory of a model under tensor parallelism, read from its arrays.

Builds the model's parameters with ``--load-format dummy``'s shapes on virtual CPU
devices, places them through the engine's own `sharding.placement.Placement` at each
tensor size, and reports per device: parameter bytes, KV-cache bytes per token, and
how many tokens of KV cache a given device memory leaves room for. With
``--materialize`` the parameters are really allocated (zeros, each device only its
shards) and counted from ``addressable_shards``; without it the same shardings are
evaluated abstractly (``sharding.shard_shape``), which needs no memory.

    python -m bench.parallel_memory --tp 1 2 4 8                # Llama-3-8B, bf16
    python -m bench.parallel_memory --tp 8 --materialize --layers 2
"""

from __future__ import annotations

import argparse
import math
import os


def llama3_8b(layers: int | None = None):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers or 32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )


def per_device_bytes(shardings, abstract, materialize: bool):
    """{device: bytes} of the parameters placed by ``shardings``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    held: dict = {}
    if materialize:
        zeros = jax.jit(
            lambda: jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), abstract),
            out_shardings=shardings,
        )
        params = zeros()
        for leaf in jax.tree_util.tree_leaves(params):
            for shard in leaf.addressable_shards:
                held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
        del params
        return held
    for leaf, sharding in zip(
        jax.tree_util.tree_leaves(abstract), jax.tree_util.tree_leaves(shardings), strict=True
    ):
        nbytes = math.prod(sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        for device in sharding.device_set:
            held[device] = held.get(device, 0) + nbytes
    return held


def measure(tp: int, layers: int | None, dtype: str, materialize: bool) -> dict:
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from jaxengine.config.parallel import ParallelConfig
    from jaxengine.loader.params import abstract_params, logical_axes
    from jaxengine.models import get_model
    from sharding.placement import Placement

    module, config = get_model(llama3_8b(layers), getattr(jnp, dtype))
    boxed = abstract_params(module, config)
    abstract = nn.unbox(boxed)
    placement = Placement(ParallelConfig(tensor_parallel_size=tp), jax.devices()[:tp])
    shardings = placement(config, logical_axes(boxed), abstract)
    held = per_device_bytes(shardings, abstract, materialize)
    plan = placement.plans[0]
    itemsize = jnp.dtype(config.dtype).itemsize
    kv_per_token = len(config.layers) * 2 * plan.kv_heads_per_device * config.head_dim * itemsize
    leaves = jax.tree_util.tree_leaves(abstract)
    total = sum(leaf.size * jnp.dtype(leaf.dtype).itemsize for leaf in leaves)
    return {
        "tp": tp,
        "devices": len(held),
        "params_total": total,
        "params_per_device": max(held.values()),
        "params_min_device": min(held.values()),
        "kv_per_token": kv_per_token,
        "kv_heads_per_device": plan.kv_heads_per_device,
    }


def measure_engine(tp: int, layers: int | None, dtype: str, kv_blocks: int) -> dict:
    """The same figures from a real engine: `LLM(..., load_format="dummy")` (random
    weights, every device initializing only its shards) with ``kv_blocks`` KV pages."""
    import tempfile

    from jaxengine import LLM
    from sharding.memory import bytes_per_device

    folder = tempfile.mkdtemp(prefix="llama3-8b-config-")
    llama3_8b(layers).save_pretrained(folder)
    llm = LLM(
        model=folder,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype=dtype,
        tensor_parallel_size=tp,
        enforce_eager=True,
        max_model_len=2048,
        num_gpu_blocks_override=kv_blocks,
        swap_space=0,
        enable_compilation_cache=False,
    )
    runner = llm.engine.executor.runner
    params, kv = bytes_per_device(runner.params), bytes_per_device(runner.kv_caches)
    llm.shutdown()
    return {"params": sorted(set(params.values())), "kv": sorted(set(kv.values()))}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--materialize", action="store_true")
    parser.add_argument(
        "--engine",
        action="store_true",
        help="also build the engine with dummy weights and count its arrays' shards",
    )
    parser.add_argument("--kv-blocks", type=int, default=1025, help="KV pages for --engine")
    parser.add_argument(
        "--device-gib", type=float, default=80.0, help="device memory for the KV-token column"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    try:  # virtual CPU devices for the largest tensor size, unless JAX already started
        jax.config.update("jax_num_cpu_devices", max(args.tp))
    except RuntimeError:
        pass
    if len(jax.devices()) < max(args.tp):
        parser.error(f"--tp {max(args.tp)} needs that many devices; {len(jax.devices())} exist")
    gib = 1 << 30
    model = "model" if args.layers is None else f"{args.layers}-layer model"
    print(
        f"| TP | parameters per device (GiB) | share of {model} "
        f"| KV heads per device | KV cache per token per device (KiB) "
        f"| KV tokens in the rest of {args.device_gib:g} GiB |"
    )
    print("|---|---|---|---|---|---|")
    for tp in args.tp:
        m = measure(tp, args.layers, args.dtype, args.materialize)
        assert m["params_per_device"] == m["params_min_device"], m
        free = args.device_gib * gib - m["params_per_device"]
        print(
            f"| {tp} | {m['params_per_device'] / gib:.2f} | "
            f"{m['params_per_device'] / m['params_total']:.3f} | {m['kv_heads_per_device']} | "
            f"{m['kv_per_token'] / 1024:.0f} | {int(free // m['kv_per_token']):,} |"
        )
        if args.engine:
            e = measure_engine(tp, args.layers, args.dtype, args.kv_blocks)
            print(
                f"|   engine, dummy weights | params {[f'{b / gib:.3f}' for b in e['params']]} GiB "
                f"| KV cache ({args.kv_blocks} pages of 16) "
                f"{[f'{b / gib:.3f}' for b in e['kv']]} GiB per device | | | |"
            )


if __name__ == "__main__":
    main()
