"""The RL rollout calls timed: weight updates against reloading, and sleep/wake.

One engine (SmolLM2-135M-Instruct by default, sleep mode on) and, in the same run:

- ``update_weights`` from the checkpoint's tensors already in host memory (numpy), and
  from the same tensors already on the device (`jax.Array`s: what a colocated JAX
  trainer hands over);
- ``reload_weights()``: the checkpoint read again and written in;
- a new engine built from the checkpoint (what a trainer without weight updates pays:
  ``enforce_eager``, so the figure is the load, not the compilation);
- ``sleep(1)`` then ``wake_up()``; ``sleep(2)``, ``wake_up(["weights"])``,
  ``update_weights`` (device arrays), ``wake_up(["kv_cache"])`` (TRL's order).

Each is the median of ``--repeats``; after each the greedy answer is checked against
the first one, so no figure comes from an engine that answers differently.

    python -m bench.rollout
    python -m bench.rollout --model /path/to/hf-folder --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def _timed(fn: Callable[[], object], repeats: int, check: Callable[[], None]) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        check()
    return statistics.median(times)


def run(args: argparse.Namespace) -> dict[str, float]:
    import jax

    from jaxengine import LLM, SamplingParams
    from jaxengine.loader import checkpoint_tensors

    kwargs = dict(max_model_len=256, max_num_batched_tokens=64, compile_token_buckets=[64],
                  enforce_eager=True, enable_sleep_mode=True)  # fmt: skip
    llm = LLM(args.model, **kwargs)
    greedy = SamplingParams(temperature=0, max_tokens=16)

    def answer():
        return [o.outputs[0].text for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]

    want = answer()

    def check():
        assert answer() == want, "the engine answers differently"

    config = llm.engine.config
    host = dict(checkpoint_tensors(config.model_config, config.load_config))
    device = {name: jax.device_put(array) for name, array in host.items()}
    jax.block_until_ready(list(device.values()))

    def trl_cycle():
        llm.sleep(2)
        llm.wake_up(["weights"])
        llm.update_weights(device)
        llm.wake_up(["kv_cache"])

    def sleep_wake():
        llm.sleep(1)
        llm.wake_up()

    def fresh_engine():
        LLM(args.model, **kwargs).shutdown()

    r = args.repeats
    figures = {
        "update_weights (host numpy)": _timed(lambda: llm.update_weights(host), r, check),
        "update_weights (device arrays)": _timed(lambda: llm.update_weights(device), r, check),
        "reload_weights (read the checkpoint)": _timed(llm.reload_weights, r, check),
        "new engine from the checkpoint": _timed(fresh_engine, r, lambda: None),
        "sleep(1) + wake_up()": _timed(sleep_wake, r, check),
        "sleep(2) + wake + update + wake": _timed(trl_cycle, r, check),
    }
    llm.shutdown()
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    figures = run(args)
    base = figures["update_weights (device arrays)"]
    print(f"| {args.model} | seconds (median of {args.repeats}) | x update (device) |")
    print("|---|---:|---:|")
    for name, seconds in figures.items():
        print(f"| {name} | {seconds:.3f} | {seconds / base:.1f} |")


if __name__ == "__main__":
    main()
