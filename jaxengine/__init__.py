"""jaxengine: a vLLM-class LLM inference and serving engine in JAX/XLA.

Public names load lazily so that `jaxengine --help` and the host-side modules never
import jax. Importing the package first picks the CPU where libtpu is installed but
no TPU is (`jaxengine.platforms`), so ``from jaxengine import LLM`` in a notebook on
such a machine starts JAX quietly, as the CLI does.
"""

from __future__ import annotations

import importlib

from jaxengine.platforms import cpu_unless_a_tpu
from jaxengine.version import __version__

cpu_unless_a_tpu()  # before anything starts JAX (a no-op once the user has chosen)

_LAZY = {
    "LLM": "jaxengine.entrypoints.llm",
    "EngineArgs": "jaxengine.engine_args",
    "SamplingParams": "jaxengine.sampling_params",
    "BeamSearchParams": "jaxengine.beam_search",
    "StructuredOutputsParams": "jaxengine.structured_params",
    "RequestOutput": "jaxengine.outputs",
    "CompletionOutput": "jaxengine.outputs",
    "LoRARequest": "jaxengine.lora",
    "PoolingParams": "jaxengine.pooling_params",
    "PoolingRequestOutput": "jaxengine.outputs",
    "EmbeddingRequestOutput": "jaxengine.outputs",
    "ClassificationRequestOutput": "jaxengine.outputs",
    "ScoringRequestOutput": "jaxengine.outputs",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxengine' has no attribute {name!r}")
