"""Batch-1 decode speed of one engine against the memory roofline.

A batch-1 decode step reads every weight once, so its ceiling is
``copy bandwidth / weight bytes`` tokens per second. This script builds the engine on
a model config with dummy weights (Llama-3-8B's by default, bfloat16), decodes one
request, and reports tokens/s, the roofline and the fraction reached:

    fraction = weight bytes x tokens/s / measured copy bandwidth

Decode time is taken between two runs of the same prompt that differ only in
``max_tokens`` (so prefill, the first token and the request overhead cancel), each
the median of ``--repeats``. The copy bandwidth is an elementwise pass (read + write)
over ``--copy-mib`` of the device's memory (`bench.kernels.copy_bandwidth`).

    python -m bench.decode_roofline                       # Llama-3-8B on the default device
    python -m bench.decode_roofline --layers 2 --tokens 16 # a quick check
    python -m bench.decode_roofline --quantization int8    # int8 weights (or fp8)

The weight bytes are those of the placed parameter tree, so quantized weights (and
their scales) count at their stored size.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def llama_config(layers: int | None, small: bool):
    from bench.parallel_memory import llama3_8b

    if not small:
        return llama3_8b(layers)
    import transformers

    return transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers or 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )


def decode_seconds(llm, prompt: list[int], tokens: int, repeats: int) -> float:
    """Median seconds of a ``tokens``-token greedy generation of ``prompt``."""
    from jaxengine import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_rate(llm, prompt_len: int, tokens: int, repeats: int, seconds=None) -> float:
    """Batch-1 decode tokens/s of ``llm``: ``tokens`` over the difference between a
    generation of ``1 + tokens`` tokens and one of 1 token from the same
    ``prompt_len``-token prompt (medians of ``repeats``), so prefill, the first token
    and the request overhead cancel. ``seconds(prompt, new_tokens)`` times one
    generation of another generator (a peer: `bench.device.peer`); ``llm`` is then
    unused."""
    if seconds is None:
        seconds = lambda prompt, n: decode_seconds(llm, prompt, n, 1)  # noqa: E731
    prompt = [1 + i % 100 for i in range(prompt_len)]
    seconds(prompt, 1 + tokens)  # first calls: any lazy work (a compile)
    seconds(prompt, 1)
    short = statistics.median(seconds(prompt, 1) for _ in range(repeats))
    long = statistics.median(seconds(prompt, 1 + tokens) for _ in range(repeats))
    return tokens / max(long - short, 1e-9)


def run(args: argparse.Namespace) -> dict:
    import jax
    import jax.numpy as jnp

    from bench.kernels import copy_bandwidth
    from jaxengine import LLM
    from sharding.memory import total_bytes

    folder = tempfile.mkdtemp(prefix="decode-roofline-")
    llama_config(args.layers, args.small).save_pretrained(folder)
    llm = LLM(
        model=folder,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype=args.dtype,
        quantization=args.quantization,
        tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=args.prompt_len + args.tokens + 16,
        max_num_seqs=1,
        max_num_batched_tokens=max(args.prompt_len, 16),
        swap_space=0,
        enable_prefix_caching=False,
    )
    try:
        runner = llm.engine.executor.runner
        weights = total_bytes(runner.params)
        tokens_per_s = decode_rate(llm, args.prompt_len, args.tokens, args.repeats)
        bandwidth = copy_bandwidth(jnp.bfloat16, 5, args.copy_mib << 20)
        per_device = weights / args.tensor_parallel_size
        return {
            "device": str(jax.devices()[0].device_kind),
            "weights_gib": weights / (1 << 30),
            "tokens_per_s": tokens_per_s,
            "ms_per_token": 1000 / tokens_per_s,
            "copy_gb_s": bandwidth / 1e9,
            "roofline_tokens_per_s": bandwidth / per_device,
            "fraction": per_device * tokens_per_s / bandwidth,
        }
    finally:
        llm.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    parser.add_argument("--small", action="store_true", help="a tiny config (tests)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", choices=["int8", "fp8"], default=None)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=128, help="decode tokens timed")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--copy-mib", type=int, default=2048)
    args = parser.parse_args(argv)
    r = run(args)
    print(
        "| device | weights | weights (GiB) | batch-1 decode tok/s | ms/token | copy GB/s "
        "| roofline tok/s | fraction of roofline |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {r['device']} | {args.quantization or args.dtype} | {r['weights_gib']:.2f} "
        f"| {r['tokens_per_s']:.1f} "
        f"| {r['ms_per_token']:.2f} | {r['copy_gb_s']:.0f} | {r['roofline_tokens_per_s']:.1f} "
        f"| {r['fraction']:.2f} |"
    )


if __name__ == "__main__":
    main()
