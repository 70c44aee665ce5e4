"""The peer section: transformers' Llama at the engine section's shape, on torch.

The model is `transformers.LlamaForCausalLM` built from the same config
(`bench.decode_roofline.llama_config`: Llama-3-8B's shape, ``--layers`` honoured; the
tiny Llama in the dry run) with random bf16 weights, on ``cuda`` (the GPU run: a
torch without CUDA is this section's error, not the run's end) or the CPU (the dry
run). It runs transformers' documented fast path: ``model.generate`` with
``cache_implementation="static"``, which on CUDA compiles the decoding forward with
``torch.compile`` (transformers' ``CompileConfig``: ``mode="reduce-overhead"``, CUDA
graphs) on its first call. transformers compiles on CUDA only, and the dry run turns
it off (``disable_compile``): a CPU compile would take minutes; the record says so.

Items:

- ``build``: the model on the device (seconds), the versions, compiled or not;
- ``decode``: batch-1 decode tok/s as the engine's (`bench.decode_roofline.decode_rate`'s
  method: a generation of ``1 + decode_tokens`` tokens against one of 1 token from the
  same ``prompt_len``-token prompt, medians of ``repeats``, after one warm-up of each,
  the first compiling), and ``engine_over_peer``: the engine's batch-1 tok/s over it;
- ``prefill``: a fresh ``ttft_len``-token prompt to its first token (one eager forward:
  transformers compiles the decoding steps only), median of 3 after a warm-up, and
  ``engine_over_peer``: this time over the engine's TTFT at the same length (> 1: the
  engine is faster).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any

from bench.device.profile import Profile


class Peer:
    """The torch model and how it generates."""

    def __init__(self, profile: Profile, layers: int | None) -> None:
        import torch
        import transformers

        from bench.decode_roofline import llama_config

        self.device = profile.peer_device
        if self.device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"torch {torch.__version__} sees no CUDA device")
        self.compile = self.device == "cuda"
        config = llama_config(layers, profile.small_model)
        self.vocab = config.vocab_size
        torch.manual_seed(0)
        start = time.perf_counter()
        with torch.device(self.device), _default_dtype(torch.bfloat16):
            self.model = transformers.LlamaForCausalLM(config).eval()
        self.sync()
        self.build_s = time.perf_counter() - start

    def sync(self) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()

    def seconds(self, prompt: list[int], new_tokens: int) -> float:
        """Seconds of one greedy generation of exactly ``new_tokens`` tokens."""
        import torch
        import transformers

        config = transformers.GenerationConfig(
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
            cache_implementation="static", pad_token_id=0,
        )  # fmt: skip
        config.disable_compile = not self.compile
        ids = torch.tensor([prompt], device=self.device)
        self.sync()
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, generation_config=config)
        self.sync()
        if out.shape[1] != len(prompt) + new_tokens:
            raise RuntimeError(f"generated {out.shape[1] - len(prompt)} of {new_tokens} tokens")
        return time.perf_counter() - start

    def close(self) -> None:
        import torch

        del self.model
        if self.device == "cuda":
            torch.cuda.empty_cache()


@contextlib.contextmanager
def _default_dtype(dtype: Any):
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def decode(peer: Peer, profile: Profile, engine_tok_s: float | None) -> dict[str, Any]:
    from bench.decode_roofline import decode_rate

    p = profile  # the engine's method and prompt; the warm-up compiles the step (CUDA)
    tok_s = decode_rate(None, p.prompt_len, p.decode_tokens, p.repeats, peer.seconds)
    ratio = engine_tok_s / tok_s if engine_tok_s else None
    return {"tok_s": tok_s, "ms_per_token": 1000 / tok_s, "engine_over_peer": ratio}


def prefill(peer: Peer, profile: Profile, engine_ttft_s: float | None) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, peer.vocab, profile.ttft_len).tolist() for _ in range(4)]
    peer.seconds(prompts[0], 1)  # warm-up (and the static cache at this length)
    median = statistics.median(peer.seconds(p, 1) for p in prompts[1:])
    ratio = median / engine_ttft_s if engine_ttft_s else None
    return {"prompt_len": profile.ttft_len, "ttft_s": median,
            "prefill_tok_s": profile.ttft_len / median, "engine_over_peer": ratio}  # fmt: skip


def _figure(engine: dict[str, Any], item: str, key: str) -> float | None:
    value = engine.get(item, {}).get(key) if isinstance(engine.get(item), dict) else None
    return value if isinstance(value, (int, float)) else None


def build(state: dict[str, Any], profile: Profile, layers: int | None) -> dict[str, Any]:
    import torch
    import transformers

    peer = state["peer"] = Peer(profile, layers)
    note = "torch.compile by transformers (static cache)" if peer.compile else (
        "eager: transformers compiles on CUDA only, and the dry run leaves it off")  # fmt: skip
    return {"device": peer.device, "build_s": peer.build_s, "compiled": peer.compile,
            "note": note, "torch": torch.__version__,
            "transformers": transformers.__version__}  # fmt: skip


def run(section: Any, profile: Profile, layers: int | None, engine: dict[str, Any]) -> None:
    """The items; ``engine`` is the engine section's record (its figures, the ratios'
    numerators; absent ones leave the ratios None)."""
    state: dict[str, Any] = {}
    try:
        section.item("build", lambda: build(state, profile, layers))
        if "peer" not in state:
            return
        peer = state["peer"]
        tok_s, ttft_s = _figure(engine, "decode", "tok_s"), _figure(engine, "ttft", "ttft_s")
        section.item("decode", lambda: decode(peer, profile, tok_s))
        section.item("prefill", lambda: prefill(peer, profile, ttft_s))
    finally:
        if "peer" in state:
            state.pop("peer").close()
