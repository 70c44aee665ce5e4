"""jaxengine: a vLLM-class LLM inference and serving engine in JAX/XLA.

Public names load lazily so that `jaxengine --help` and the host-side modules never
import jax.
"""

from __future__ import annotations

import importlib

from jaxengine.version import __version__

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
