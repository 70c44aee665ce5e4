"""Loading a transformers PyTorch model for `--model-impl transformers`.

`load_torch_model` resolves the model as the JAX loader does (folder, .gguf, demo
name), builds ``AutoModelForCausalLM`` on the checkpoint (safetensors, or a GGUF
through transformers' own loader; random weights for ``--load-format dummy``) with
the paged attention function (`torch_fallback.attention`), and describes it as a
`TransformerConfig` (sizes only) so the engine sizes its KV cache and limits as for
a JAX model. It runs on CUDA when torch sees a GPU, else on CPU.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from jaxengine.config import EngineConfig
from jaxengine.loader import LoadedModel, resolve_dtype, resolve_source
from jaxengine.models.layers.config import LayerSpec, RopeSpec, TransformerConfig
from torch_fallback.attention import NAME, register
from torch_fallback.program import TORCH_DTYPES

logger = logging.getLogger("jaxengine.torch_fallback")  # under the engine's log handler

_UNSUPPORTED_LOGIT_SCALING = ("logit_scale", "logits_scaling")


def torch_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check_fallback(config: EngineConfig) -> None:
    """Refuses what the fallback does not run, naming the flag."""
    parallel, cache = config.parallel_config, config.cache_config
    refused = {
        "--tensor-parallel-size": parallel.tensor_parallel_size != 1,
        "--pipeline-parallel-size": parallel.pipeline_parallel_size != 1,
        "--nnodes": parallel.nnodes != 1 or parallel.distributed_executor_backend == "ray",
        "--async-scheduling": config.scheduler_config.async_scheduling,
        "--quantization": config.model_config.quantization not in (None, "gguf"),
        "--kv-cache-dtype": cache.kv_cache_dtype.startswith("fp8"),
        "--enable-lora": config.lora_config.enable_lora,  # no adapter slots in PyTorch
    }
    bad = [flag for flag, is_bad in refused.items() if is_bad]
    if bad:
        raise NotImplementedError(
            f"{', '.join(bad)} is not supported with --model-impl transformers yet"
        )


def load_torch_model(config: EngineConfig) -> LoadedModel:
    mc, lc = config.model_config, config.load_config
    check_fallback(config)
    source, hf_config = resolve_source(mc, lc)
    for name in _UNSUPPORTED_LOGIT_SCALING:
        if getattr(hf_config, name, None) not in (None, 1, 1.0):
            raise NotImplementedError(
                f"--model-impl transformers: models with {name} are not supported yet"
            )
    device = torch_device()
    dtype = resolve_dtype(mc.dtype, hf_config, "cpu" if device.type == "cpu" else "gpu")
    try:
        model = _build(
            source, hf_config, TORCH_DTYPES[np.dtype(dtype).name], lc.load_format, mc.seed
        )
    except (KeyError, ValueError) as e:
        if NAME not in str(e):
            raise
        arch = (getattr(hf_config, "architectures", None) or [hf_config.model_type])[0]
        raise NotImplementedError(
            f"--model-impl transformers cannot run {arch}: its transformers implementation "
            "does not take an attention function (transformers' AttentionInterface)"
        ) from e
    model.to(device).eval()
    logger.info("loaded %s with transformers' %s on %s", mc.model, type(model).__name__, device)
    return LoadedModel(model, describe(hf_config, dtype), model, hf_config, source, None)


def _build(source: Any, hf_config: Any, dtype: torch.dtype, load_format: str, seed: int):
    from transformers import AutoModelForCausalLM

    register()
    kwargs = dict(dtype=dtype, attn_implementation=NAME)
    if load_format == "dummy":
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(hf_config, **kwargs)
    if source.gguf_file is not None:
        folder, name = source.gguf_file.parent, source.gguf_file.name
        return AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=name, **kwargs)
    return AutoModelForCausalLM.from_pretrained(str(source.path), config=hf_config, **kwargs)


def describe(hf_config: Any, dtype: Any) -> TransformerConfig:
    """The sizes the engine reads (layers, KV heads, head size, vocabulary, sliding
    window) of any transformers decoder config."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    window = getattr(hf_config, "sliding_window", None)
    layer = LayerSpec(rope=RopeSpec(), sliding_window=window if isinstance(window, int) else None)
    return TransformerConfig(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=getattr(hf_config, "intermediate_size", None) or 0,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        layers=(layer,) * hf_config.num_hidden_layers,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        dtype=dtype,
    )
