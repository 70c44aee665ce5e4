"""The peers a benchmark runs side by side: jaxengine, transformers and llama.cpp.

Every peer has the same small surface: constructed once (the timed "load"), then
``generate(prompts, output_len) -> ids`` takes a list of token-id prompts and returns,
for each, exactly ``output_len`` greedy tokens, ignoring EOS. A peer that cannot run
here (package missing, API not written yet) raises `Unavailable` from its constructor,
so that `run_peer` reports it and the other peers still run.

- jaxengine: vLLM's offline API, ``LLM(model, **engine_kwargs).generate(...)``; the
  engine batches the requests itself (continuous batching). ``jaxengine_async`` is
  the same with ``async_scheduling=True``.
- transformers: float32 on CPU (weights dequantized from the GGUF), ``generate`` on
  left-padded batches of ``hf_batch_size`` prompts.
- llama.cpp (``llama-cpp-python``, optional): its own quantized kernels on the GGUF
  as is; no batched API, so requests run one after another.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from time import perf_counter
from typing import Any, Protocol

from jaxengine.benchmarks.common import ModelFiles, PeerResult, log
from jaxengine.extras import TORCH_INSTALL

_REPO = Path(__file__).resolve().parents[2]


class Unavailable(Exception):
    """The peer cannot run on this machine; the message says why."""


@dataclass(frozen=True)
class PeerOptions:
    """What every peer may need to know to load itself."""

    model: ModelFiles
    threads: int
    """CPU threads for torch and llama.cpp."""
    max_len: int
    """Longest prompt plus output: llama.cpp's context size."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra LLM(...) arguments for jaxengine."""
    hf_batch_size: int | None = None
    """Prompts per transformers ``generate`` call (None: all at once)."""
    llamacpp_n_batch: int = 512


class Peer(Protocol):
    name: str
    batched: bool
    """Whether the requests of one ``generate`` call run together (else one by one)."""

    def generate(self, prompts: list[list[int]], output_len: int) -> list[list[int]]: ...

    def close(self) -> None: ...


# --------------------------------------------------------------------------- jaxengine


class JaxEnginePeer:
    """jaxengine through vLLM's offline API."""

    name = "jaxengine"
    batched = True

    def __init__(self, opts: PeerOptions):
        try:
            from jaxengine import LLM, SamplingParams
        except (ImportError, AttributeError) as e:
            raise Unavailable(f"jaxengine.LLM cannot be imported ({e})") from e
        self._sampling_params = SamplingParams
        self._llm = LLM(model=opts.model.name, **opts.engine_kwargs)

    def generate(self, prompts: list[list[int]], output_len: int) -> list[list[int]]:
        params = self._sampling_params(max_tokens=output_len, ignore_eos=True, temperature=0.0)
        requests = [{"prompt_token_ids": ids} for ids in prompts]
        outputs = self._llm.generate(requests, params, use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outputs]

    def close(self) -> None:
        shutdown = getattr(self._llm, "shutdown", None)
        if callable(shutdown):
            shutdown()
        del self._llm


class JaxEngineAsyncPeer(JaxEnginePeer):
    """jaxengine with ``async_scheduling=True`` (the next step is scheduled while the
    device runs the current one), beside the synchronous engine in the same run."""

    name = "jaxengine_async"

    def __init__(self, opts: PeerOptions):
        kwargs = {**opts.engine_kwargs, "async_scheduling": True}
        super().__init__(replace(opts, engine_kwargs=kwargs))


# --------------------------------------------------------------------------- transformers


class TransformersPeer:
    """transformers ``generate`` in float32 on CPU, batched with left padding."""

    name = "transformers"
    batched = True

    def __init__(self, opts: PeerOptions):
        try:
            import torch
            import transformers
        except ImportError as e:
            raise Unavailable(f"torch/transformers not installed ({e}): {TORCH_INSTALL}") from e
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        torch.set_num_threads(opts.threads)
        self._torch = torch
        files = opts.model
        kwargs: dict[str, Any] = {"dtype": torch.float32}
        if files.gguf is not None:
            kwargs["gguf_file"] = files.gguf.name
        model = transformers.AutoModelForCausalLM.from_pretrained(str(files.folder), **kwargs)
        self._model = model.eval()
        self._batch_size = opts.hf_batch_size
        config = copy.deepcopy(model.generation_config)
        # Greedy, and no EOS at all, so that every sequence runs to max_new_tokens
        # (vLLM's ignore_eos) with no logits processor in the way; sampling fields
        # are cleared so that generate() does not warn about them.
        pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
        self._pad = _first(pad, default=0)
        config.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        config.eos_token_id = None
        config.pad_token_id = self._pad
        self._config = config

    def generate(self, prompts: list[list[int]], output_len: int) -> list[list[int]]:
        size = self._batch_size or len(prompts)
        outputs: list[list[int]] = []
        for start in range(0, len(prompts), size):
            outputs += self._generate_batch(prompts[start : start + size], output_len)
        return outputs

    def _generate_batch(self, prompts: list[list[int]], output_len: int) -> list[list[int]]:
        torch = self._torch
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self._pad, dtype=torch.long)  # [B, S]
        mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, S]
        for row, prompt in enumerate(prompts):  # left padding: prompts end together
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        with torch.inference_mode():
            out = self._model.generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=self._config,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
            )  # [B, S + output_len]
        return out[:, width:].tolist()

    def close(self) -> None:
        del self._model


def _first(value: int | list[int] | None, default: int) -> int:
    if isinstance(value, list | tuple):
        return int(value[0]) if value else default
    return default if value is None else int(value)


# --------------------------------------------------------------------------- llama.cpp


class LlamaCppPeer:
    """llama.cpp through llama-cpp-python, one request after another, greedy."""

    name = "llamacpp"
    batched = False

    def __init__(self, opts: PeerOptions):
        try:
            import llama_cpp
            import numpy as np
        except ImportError as e:
            raise Unavailable(f"llama-cpp-python not installed ({e})") from e
        if opts.model.gguf is None:
            raise Unavailable("llama.cpp needs a .gguf model")
        self._np, self._llama_cpp = np, llama_cpp
        self.notes: list[str] = []
        extra_bufts = _llamacpp_works(opts.model.gguf, extra_bufts=True)
        if not extra_bufts:
            if not _llamacpp_works(opts.model.gguf, extra_bufts=False):
                raise Unavailable("llama.cpp crashes on a multi-token eval here")
            self.notes.append("llama.cpp extra buffer types (AMX, repack) off: they fault here")
        with _model_params(llama_cpp, use_extra_bufts=extra_bufts):
            self._llm = llama_cpp.Llama(
                model_path=str(opts.model.gguf),
                n_ctx=opts.max_len + 8,
                n_batch=opts.llamacpp_n_batch,
                n_threads=opts.threads,
                n_threads_batch=opts.threads,
                logits_all=False,
                verbose=False,
            )
        self._n_vocab = self._llm.n_vocab()

    def generate(self, prompts: list[list[int]], output_len: int) -> list[list[int]]:
        return [self._generate_one(prompt, output_len) for prompt in prompts]

    def _generate_one(self, prompt: list[int], output_len: int) -> list[int]:
        """Greedy decoding by hand: argmax of the last logits, never stopping at EOS.

        ``reset()`` rewinds the context to empty (``eval`` drops the stale KV entries
        past it), so no prompt reuses another one's cache. With ``logits_all=False``
        llama.cpp keeps the logits of the last evaluated token only, read in place.
        """
        llm, np, llama_cpp = self._llm, self._np, self._llama_cpp
        llm.reset()
        llm.eval(prompt)
        tokens: list[int] = []
        for step in range(output_len):
            logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
            token = int(np.argmax(np.ctypeslib.as_array(logits, shape=(self._n_vocab,))))
            tokens.append(token)
            if step + 1 < output_len:
                llm.eval([token])
        return tokens

    def close(self) -> None:
        close = getattr(self._llm, "close", None)
        if callable(close):
            close()
        del self._llm


@contextlib.contextmanager
def _model_params(llama_cpp: Any, **fields: Any) -> Iterator[None]:
    """Makes ``Llama()`` load its model with these ``llama_model_params`` fields.

    ``Llama.__init__`` starts from ``llama_model_default_params()`` and exposes no
    argument for fields such as ``use_extra_bufts``, so the default is wrapped while
    the model loads.
    """
    low_level = llama_cpp.llama_cpp
    default = low_level.llama_model_default_params

    def params() -> Any:
        p = default()
        for name, value in fields.items():
            setattr(p, name, value)
        return p

    low_level.llama_model_default_params = params
    try:
        yield
    finally:
        low_level.llama_model_default_params = default


def _llamacpp_works(gguf: Path, extra_bufts: bool) -> bool:
    """Whether llama.cpp survives a multi-token eval, tried in a child process.

    llama.cpp puts weights in "extra" buffer types when the CPU has the features (AMX
    tiles, repacked layouts) and runs batched matmuls there. Where the kernel does not
    grant a process the AMX tile state (some VMs) a build with AMX dies of a general
    protection fault on the first prompt of more than one token: a crash no Python
    code can catch, which would take the other peers' results with it.
    """
    cmd = [
        sys.executable,
        "-m",
        "jaxengine.benchmarks.peers",
        "probe-llamacpp",
        str(gguf),
        str(int(extra_bufts)),
    ]
    try:
        result = subprocess.run(cmd, cwd=_REPO, capture_output=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return False
    if result.returncode != 0:
        log(f"llamacpp: probe with extra_bufts={extra_bufts} failed ({result.returncode})")
    return result.returncode == 0


def _probe_llamacpp(gguf: str, extra_bufts: bool) -> None:
    import llama_cpp

    with _model_params(llama_cpp, use_extra_bufts=extra_bufts):
        llm = llama_cpp.Llama(model_path=gguf, n_ctx=64, n_threads=1, verbose=False)
    llm.eval(list(range(100, 116)))


# --------------------------------------------------------------------------- running

PEERS: dict[str, Callable[[PeerOptions], Peer]] = {
    "jaxengine": JaxEnginePeer,
    "jaxengine_async": JaxEngineAsyncPeer,
    "transformers": TransformersPeer,
    "llamacpp": LlamaCppPeer,
}


def run_peer(
    name: str,
    opts: PeerOptions,
    measure: Callable[[Peer], tuple[dict[str, float], list[str], list[list[int]]]],
) -> PeerResult:
    """Loads peer ``name`` (timed), runs ``measure`` on it, and frees it.

    ``measure`` returns (metrics, notes, last outputs). Failures never propagate: a
    missing peer gives status "unavailable", an exception gives "error" with its
    traceback on stderr, and the next peer runs.
    """
    log(f"{name}: loading")
    start = perf_counter()
    try:
        peer = PEERS[name](opts)
    except Unavailable as e:
        log(f"{name}: unavailable: {e}")
        return PeerResult(name, "unavailable", reason=str(e))
    except Exception as e:
        traceback.print_exc()
        return PeerResult(name, "error", reason=f"load failed: {type(e).__name__}: {e}")
    load_s = perf_counter() - start
    log(f"{name}: loaded in {load_s:.1f} s")
    try:
        metrics, notes, outputs = measure(peer)
        notes = [*getattr(peer, "notes", []), *notes]
    except Exception as e:
        traceback.print_exc()
        return PeerResult(name, "error", f"{type(e).__name__}: {e}", load_s=load_s)
    finally:
        peer.close()
        del peer
        gc.collect()
    return PeerResult(name, "ok", load_s=load_s, metrics=metrics, notes=notes, outputs=outputs)


# python -m jaxengine.benchmarks.peers probe-llamacpp GGUF 0|1 (see _llamacpp_works)
if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "probe-llamacpp":
        _probe_llamacpp(sys.argv[2], sys.argv[3] == "1")
    else:
        sys.exit("usage: python -m jaxengine.benchmarks.peers probe-llamacpp GGUF 0|1")
