"""Custom logits processors (``--logits-processors``): vLLM V1's interface, in JAX form.

A logits processor is a class the engine instantiates once per runner; it sees every
request (vLLM V1's semantics: a request opts in through ``SamplingParams.extra_args``,
the server's ``vllm_xargs``) and changes rows of the batch's logits inside the
compiled sampler. vLLM's names are kept: ``__init__(vllm_config, device,
is_pin_memory)``, the classmethod ``validate_params(sampling_params)``,
``is_argmax_invariant()``, ``update_state(batch_update)`` and ``apply``. Two things
differ, because the sampler is one compiled XLA program:

- ``state(num_rows)`` returns the processor's per-step inputs as a pytree (tuple,
  dict, ...) of numpy arrays whose shapes and dtypes depend on ``num_rows`` only (the
  step's row bucket), built on the host from what ``update_state`` recorded. Rows
  without a request must hold neutral values.
- ``apply(logits, state)`` is a pure JAX function of ``logits [R, V]`` (float32) and
  that state (as jax arrays), traced into every compiled sampler variant at warm-up:
  it must not read host state of ``self`` that changes (what it reads is baked in).

So a step compiles nothing new, and the logits never leave the device. Row ``i`` of
``logits`` is batch index ``i`` of the `BatchUpdate`s. As in vLLM, processors that
are not argmax invariant run before the penalties (after allowed token ids, logit
bias, bad words and min_tokens), and argmax-invariant ones after temperature and
min-p, before top-k/top-p, for random rows only: an all-greedy batch skips them.

Classes are named by qualified name (``pkg.mod:Cls`` or ``pkg.mod.Cls``, re-imported
in each worker process) or given as class objects (``LLM(logits_processors=[Cls])``).
A class that is not a subclass of `LogitsProcessor` (such as vLLM's torch processors,
whose ``apply(logits)`` takes a torch tensor) is refused at start-up, naming the class.

Host side only: no jax import here (the processor's own module may import it).
"""

from __future__ import annotations

import enum
import functools
import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxengine.sampling_params import SamplingParams


class MoveDirectionality(enum.Enum):
    """How a `MovedRequest` moves: one way (the target's request is replaced and the
    source left empty), or a swap of the two indices."""

    UNIDIRECTIONAL = enum.auto()
    SWAP = enum.auto()


RemovedRequest = int
"""The batch index a request left."""
AddedRequest = tuple[int, "SamplingParams", list[int] | None, list[int]]
"""(batch index, its params, its prompt token ids, its output token ids): the output
list is the request's live list, extended in place as tokens are generated."""
MovedRequest = tuple[int, int, MoveDirectionality]
"""(from index, to index, directionality)."""


@dataclass(frozen=True)
class BatchUpdate:
    """How the batch changed since the last step; process removed, added, moved, in
    that order. An added request may replace the one at its index."""

    batch_size: int
    """Rows of this step (including rows of requests that sample nothing this step)."""
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """A batch-level logits processor whose ``apply`` runs in the compiled sampler."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raises ValueError for a request this processor cannot serve (checked when
        the request arrives: a 400 from the server). Accepts everything by default."""
        return None

    @abstractmethod
    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        """``vllm_config``: the engine's `EngineConfig` (max_model_len resolved);
        ``device``: the `jax.sharding.Sharding` the logits have (None: the default
        device); ``is_pin_memory``: False (vLLM's argument, unused by jaxengine)."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True when ``apply`` never changes a row's argmax: greedy rows skip it."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before each step's ``state``: the batch's changes, or None."""

    @abstractmethod
    def state(self, num_rows: int) -> Any:
        """This step's inputs of ``apply``: numpy arrays whose shapes and dtypes depend
        on ``num_rows`` only (rows past the batch, and rows whose request does not use
        the processor, neutral)."""

    @abstractmethod
    def apply(self, logits: Any, state: Any) -> Any:
        """``logits [R, V]`` -> new logits of the same shape (jax, traced)."""


# ------------------------------------------------------------------ loading


def qualified_name(cls: type) -> str:
    """``module:QualName`` of a class."""
    return f"{cls.__module__}:{cls.__qualname__}"


def resolve_logits_processors(entries: Sequence[str | type] | None) -> tuple[type, ...]:
    """The classes ``entries`` name (qualified names or classes), each checked to be a
    JAX `LogitsProcessor`; ValueError naming the entry and why otherwise."""
    return tuple(_resolve_one(e) for e in entries or ())


@functools.lru_cache(maxsize=64)
def _import(name: str) -> Any:
    """The object a ``pkg.mod:Qual.Name`` or ``pkg.mod.Name`` path names."""
    module_name, sep, attr = name.partition(":")
    if not sep:
        module_name, _, attr = name.rpartition(".")
    if not module_name or not attr:
        raise ValueError(
            f"--logits-processors {name!r}: not a qualified class name (pkg.mod:Class or "
            "pkg.mod.Class)"
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"--logits-processors {name!r}: cannot import {module_name}: {exc}"
        ) from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"--logits-processors {name!r}: {module_name} has no {attr}")
        obj = getattr(obj, part)
    return obj


def _resolve_one(entry: str | type) -> type:
    cls = _import(entry) if isinstance(entry, str) else entry
    shown = entry if isinstance(entry, str) else getattr(entry, "__qualname__", repr(entry))
    if not inspect.isclass(cls):
        raise ValueError(f"--logits-processors {shown}: not a class ({type(cls).__name__})")
    if not issubclass(cls, LogitsProcessor):
        raise ValueError(
            f"--logits-processors {shown}: {qualified_name(cls)} is not a JAX logits "
            f"processor ({_why_not(cls)}); jaxengine runs processors inside its compiled "
            "sampler, so each must subclass jaxengine.logits_processor.LogitsProcessor: "
            "state(num_rows) -> numpy arrays, apply(logits, state) -> logits in jax"
        )
    if inspect.isabstract(cls):
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        raise ValueError(
            f"--logits-processors {shown}: {qualified_name(cls)} does not define "
            f"{', '.join(missing)}"
        )
    return cls


def _why_not(cls: type) -> str:
    """A short reason a class is not a JAX processor, from what it looks like."""
    bases = {f"{b.__module__}.{b.__qualname__}" for b in cls.__mro__}
    if any(b.startswith("vllm.") for b in bases):
        return "a vLLM processor, whose apply(logits) works on torch tensors"
    apply = getattr(cls, "apply", None)
    if apply is None:
        return "it has no apply method"
    try:
        params = list(inspect.signature(apply).parameters)
    except (TypeError, ValueError):
        params = []
    if params[:1] == ["self"] and len(params) == 2:
        return "its apply(logits) takes no state: vLLM's torch form"
    return "not a subclass of jaxengine.logits_processor.LogitsProcessor"


def validate_request(classes: Sequence[type], params: SamplingParams) -> None:
    """Each processor's ``validate_params`` on a request's params (ValueError: 400)."""
    for cls in classes:
        cls.validate_params(params)
