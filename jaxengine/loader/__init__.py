"""Model loading: resolve a source, read its config, build the model and its parameters.

`load_model(model_config, load_config)` is the one entry point the engine uses:

1. `sources.resolve_model` finds the files (local folder, .gguf, demo package, hub),
   skipping those that match ``--ignore-patterns``;
2. `hf_config.load_hf_config` reads the Hugging Face config (or GGUF metadata);
3. `jaxengine.models.get_model` picks the family and builds the Linen module;
4. `params` fills the parameter tree from safetensors or GGUF tensors, or randomly
   for ``--load-format dummy``. Safetensors shards are read by
   ``--max-parallel-loading-workers`` threads when that is set.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxengine.config import LoadConfig, ModelConfig
from jaxengine.loader.errors import CheckpointError
from jaxengine.loader.quantized import (
    CHECKPOINT_METHODS,
    canonical_tensors,
    checkpoint_quantization,
    regrouped_tensors,
    tensor_parallel_group,
)
from jaxengine.loader.sources import ModelSource, resolve_model
from jaxengine.models.layers.config import with_context_length
from jaxengine.models.layers.lora import LoRASpec
from jaxengine.models.layers.quant import QuantScheme, layer_unquantized

TokenLookup = Callable[[ModelSource, list[str]], list[int | None]]
"""(model source, tokens) -> each token's id in the model's tokenizer (None: unknown)."""

logger = logging.getLogger(__name__)

_DTYPES = {
    "half": jnp.float16,
    "float16": jnp.float16,
    "bfloat16": jnp.bfloat16,
    "float": jnp.float32,
    "float32": jnp.float32,
}


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model ready to run: module, architecture config, parameters and provenance."""

    module: Any
    config: Any  # jaxengine.models.layers.config.TransformerConfig
    params: Any
    hf_config: Any
    source: ModelSource
    logical_axes: Any


def is_torch(loaded: LoadedModel) -> bool:
    """Whether the model is transformers' PyTorch one (`torch_fallback`)."""
    return loaded.logical_axes is None


def resolve_dtype(dtype: str, hf_config: Any, backend: str) -> Any:
    """The parameter dtype of ``--dtype`` for a checkpoint on ``backend``.

    ``auto`` is float32 on CPU (`config.model.auto_dtype` may have picked bfloat16
    before); on GPU and TPU it is the checkpoint's 16-bit dtype, bfloat16 for float32
    or unknown ones.
    """
    if dtype != "auto":
        return _DTYPES[dtype]
    if backend == "cpu":
        return jnp.float32
    stored = str(getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", ""))
    return jnp.float16 if stored.endswith("float16") and "bfloat" not in stored else jnp.bfloat16


def cpu_dtypes(dtype: Any, backend: str) -> tuple[Any, Any]:
    """(activation dtype, `TransformerConfig.matmul_dtype`) for parameter dtype
    ``dtype``: on CPU, bfloat16 runs as float32 activations beside bfloat16
    projections, since XLA:CPU runs a bfloat16 dot accumulated in float32 about five
    times faster than a float32 one and bfloat16 elementwise math slower than float32
    (bench/README.md). Elsewhere ``(dtype, None)``."""
    if backend == "cpu" and jnp.dtype(dtype) == jnp.bfloat16:
        return jnp.float32, jnp.bfloat16
    return dtype, None


def load_model(
    model_config: ModelConfig,
    load_config: LoadConfig,
    placement: Callable[[Any, Any, Any], Any] | None = None,
    *,
    max_parallel_loading_workers: int | None = None,
    kv_cache_scales: bool = False,
    lora: LoRASpec | None = None,
    token_ids: TokenLookup | None = None,
    abstract: bool = False,
) -> LoadedModel:
    """Resolves, reads and builds the model that ``model_config`` names.

    ``placement(config, logical_axes, abstract_params)`` gives a `NamedSharding` per
    parameter (`sharding/`); each tensor then goes straight into its shards. Without
    it the parameters land on the default device. ``max_parallel_loading_workers``
    is `ParallelConfig.max_parallel_loading_workers` (None: shards are memory-mapped).
    q/k/v and gate/up are fused where `fuse_projections` allows. ``kv_cache_scales``
    (an fp8 KV cache): attention's ``k_scale``/``v_scale``, from the checkpoint or 1.
    ``lora``: adapter slots on every projection (zero; its dtype None: the model's).
    ``token_ids(source, tokens)``: ids in the model's tokenizer (`_classifier_tensors`).
    ``abstract``: no weights read or drawn, the parameters are placed shapes (a
    compile-only engine: `worker.target`). The dtype follows the placement's platform.
    """
    from jaxengine.loader.params import (
        dummy_params,
        logical_axes,
        params_from_tensors,
        placed_shapes,
    )

    start = time.perf_counter()
    source, hf_config = resolve_source(model_config, load_config)
    stored, scheme, packed = _weight_scheme(model_config, load_config, source, hf_config)
    backend = getattr(placement, "platform", None) or jax.default_backend()
    dtype, matmul = cpu_dtypes(resolve_dtype(model_config.dtype, hf_config, backend), backend)
    if lora is not None and lora.dtype is None:
        lora = dataclasses.replace(lora, dtype=dtype)
    scheme = dense_float(scheme, hf_config, backend)
    module, config = _model(hf_config, dtype, scheme, placement, kv_cache_scales, lora)
    config = with_context_length(  # (longrope's factors)
        dataclasses.replace(config, matmul_dtype=matmul), model_config.max_model_len
    )
    module, config, abstract_tree, shardings = _placed(module.clone(config=config), placement)
    axes = logical_axes(abstract_tree)
    if abstract:
        params = placed_shapes(nn.unbox(abstract_tree), shardings)
    elif load_config.load_format == "dummy":
        params = dummy_params(module, config, model_config.seed, shardings)
    else:
        tensors = _checkpoint_tensors(source, load_config, max_parallel_loading_workers, packed)
        where = str(source.gguf_file or source.path)
        tensors = _prepared(tensors, stored, where, model_config, hf_config, source, token_ids)
        if scheme is not None and scheme.group_size != config.quantization.group_size:
            tensors = regrouped_tensors(tensors, scheme.group_size, config.quantization.group_size)
        params = params_from_tensors(module, config, tensors, where, abstract_tree, shardings)
    _log_loaded(model_config.model, module, dtype, matmul, config, start)
    return LoadedModel(module, config, params, hf_config, source, axes)


def _placed(module: Any, placement: Any) -> tuple[Any, Any, Any, Any]:
    """``(module, config, abstract params, shardings)`` of ``module`` under
    ``placement`` (None: no shardings). A grouped int8/fp8 model whose groups the
    tensor-parallel split would cut comes back in the smaller groups that it takes
    (`quantized.tensor_parallel_group`), its shapes traced again."""
    from jaxengine.loader.params import abstract_params, logical_axes

    config = module.config
    abstract = abstract_params(module, config)
    if placement is None:
        return module, config, abstract, None
    scheme = config.quantization
    group = tensor_parallel_group(
        scheme, config, logical_axes(abstract), nn.unbox(abstract), placement
    )
    if scheme is not None and group != scheme.group_size:
        config = dataclasses.replace(
            config, quantization=dataclasses.replace(scheme, group_size=group)
        )
        module = module.clone(config=config)
        abstract = abstract_params(module, config)
    return module, config, abstract, placement(config, logical_axes(abstract), nn.unbox(abstract))


def _log_loaded(name: str, module: Any, dtype: Any, matmul: Any, config: Any, start: float):
    logger.info(
        "loaded %s (%s, %s%s) in %.1fs",
        name,
        type(module).__name__,
        jnp.dtype(dtype).name + (f", {jnp.dtype(matmul).name} projections" if matmul else ""),
        f", {config.quantization} weights" if config.quantization else "",
        time.perf_counter() - start,
    )


def _prepared(tensors, stored, where: str, model_config, hf_config, source, token_ids):
    """A checkpoint's tensors in the canonical form of its quantization format, and a
    classifier's head made from LM-head rows where the model asks for one."""
    if stored is not None:
        tensors = canonical_tensors(tensors, stored, where)
    if _classifier(model_config, hf_config):
        tensors = _classifier_tensors(tensors, hf_config, where, source, token_ids)
    return tensors


def resolve_source(model_config: ModelConfig, load_config: LoadConfig) -> tuple[ModelSource, Any]:
    """The model's files and its Hugging Face config (`sources`, `hf_config`)."""
    from jaxengine.loader.hf_config import load_hf_config

    source = resolve_model(
        model_config.model,
        revision=model_config.revision,
        download_dir=load_config.download_dir,
        ignore_patterns=load_config.ignore_patterns,
    )
    hf_config = load_hf_config(
        source,
        hf_overrides=model_config.hf_overrides,
        trust_remote_code=model_config.trust_remote_code,
    )
    if _classifier(model_config, hf_config):
        from jaxengine.loader.convert import as_classifier

        hf_config = as_classifier(hf_config)
    return source, hf_config


def _classifier(model_config: ModelConfig, hf_config: Any) -> bool:
    """``--convert classify``, or a decoder's ``*ForSequenceClassification`` (named by
    the checkpoint or by ``--hf-overrides``, as LLM rerankers are): its head is the
    checkpoint's ``score.weight`` or rows of its LM head (`loader.convert`)."""
    from jaxengine.models import is_decoder_classifier

    return model_config.convert_type == "classify" or is_decoder_classifier(hf_config)


def _classifier_tensors(tensors, hf_config, where: str, source, token_ids):
    """``--convert classify``: the checkpoint's tensors with its classification head
    (`convert.classifier_tensors`); a head of LM-head rows (``classifier_from_token``)
    takes its ids from ``token_ids`` (the worker's: the loader reads no tokenizer)."""
    from jaxengine.loader.convert import classifier_tensors

    if token_ids is not None:
        return classifier_tensors(tensors, hf_config, partial(token_ids, source), where)

    def no_lookup(tokens: list[str]) -> list[int | None]:
        raise CheckpointError(
            f"{where}: classifier_from_token {tokens} needs the model's tokenizer "
            "(load_model's token_ids)"
        )

    return classifier_tensors(tensors, hf_config, no_lookup, where)


def _weight_scheme(model_config: ModelConfig, load_config: LoadConfig, source, hf_config):
    """``(quantized checkpoint format or None, QuantScheme or None, GGUF kept packed)``."""
    stored = checkpoint_format(model_config.quantization, source, hf_config)
    scheme = stored.scheme if stored else online_scheme(model_config.quantization)
    packed = source.gguf_file is not None and scheme is None and load_config.load_format != "dummy"
    if packed:
        scheme = gguf_scheme(source.gguf_file)
        packed = scheme is not None
    return stored, scheme, packed


def _model(hf_config: Any, dtype: Any, scheme: QuantScheme | None, placement: Any,
           kv_scales: bool, lora: LoRASpec | None):  # fmt: skip
    """The Flax module and its config, quantized, fused and with adapter slots as the
    load asks (adapters hold q, k, v and gate, up apart: no fusion with LoRA; nor in a
    family whose module says ``supports_fused_projections = False``, `models.bert`)."""
    from jaxengine.models import get_model

    module, config = get_model(hf_config, dtype)
    config = dataclasses.replace(config, kv_cache_scales=kv_scales, lora=lora)
    if scheme is not None:
        layers = tuple(
            dataclasses.replace(spec, unquantized=layer_unquantized(scheme.unquantized, i))
            for i, spec in enumerate(config.layers)
        )
        config = dataclasses.replace(config, quantization=scheme, layers=layers)
    fusable = getattr(type(module), "supports_fused_projections", True) and lora is None
    # act-order's per-column groups differ between q, k and v: they stay apart; so do
    # they where the checkpoint keeps modules unquantized (named apart, not fused)
    apart = scheme is not None and (scheme.act_order or bool(scheme.unquantized))
    if fusable and fuse_projections(placement) and not apart:
        config = dataclasses.replace(config, fused_projections=True)
    return module.clone(config=config), config


DENSE_FLOAT_ENV = "JAXENGINE_DENSE_FLOAT"
"""``1``: `dense_float` on any backend; ``0``: on none (the experts' scheme everywhere)."""


def dense_float(scheme: QuantScheme | None, hf_config: Any, backend: str) -> QuantScheme | None:
    """``scheme`` with `QuantScheme.dense_float` where a block-scaled 8-bit MoE
    checkpoint (DeepSeek-V3's fp8 with 128 x 128 blocks) loads on TPU: its routed
    experts stay 8-bit (the grouped kernel decodes their blocks in VMEM), its other
    projections are dequantized at load. XLA:TPU writes the scales' broadcast over a
    block-scaled weight to HBM in float32 each step (a 1536 x 7168 projection read as
    100 MB instead of its 11 MB: `python -m bench.tpu_hbm deepseek-v3@v5p-32 --tokens 1
    --layers 5`), 4.5 times its bfloat16 weight's bytes; the dense projections are a
    small part of such a model. ``$JAXENGINE_DENSE_FLOAT`` overrides the backend."""
    if scheme is None or not scheme.group_size or scheme.method not in ("fp8", "int8"):
        return scheme
    if scheme.act_order or not _has_routed_experts(hf_config):
        return scheme
    default = "1" if backend == "tpu" else "0"
    if os.environ.get(DENSE_FLOAT_ENV, default) != "1":
        return scheme
    return dataclasses.replace(scheme, dense_float=True)


def _has_routed_experts(hf_config: Any) -> bool:
    text = getattr(hf_config, "text_config", None) or hf_config
    return any(
        (getattr(text, name, None) or 0) > 1
        for name in ("n_routed_experts", "num_experts", "num_local_experts")
    )


GGUF_PACKED_ENV = "JAXENGINE_GGUF_PACKED"
"""``1``: keep GGUF projections packed on CPU too; ``0``: dequantize them everywhere."""


def gguf_scheme(path: Any) -> QuantScheme | None:
    """The scheme a GGUF file's projections load as: packed (`gguf_packed`) on TPU and
    GPU when every projection is Q8_0, or every one Q4_0/Q4_1; None (dequantized to
    the model dtype at load) on CPU, where XLA converts packed weights in every step
    (SmolLM2 Q4_1 decode measured several times slower, bench/README.md), and for
    other types. ``$JAXENGINE_GGUF_PACKED`` overrides the backend's default."""
    from jaxengine.loader.gguf_io import gguf_packed_method

    default = "0" if jax.default_backend() == "cpu" else "1"
    if os.environ.get(GGUF_PACKED_ENV, default) != "1":
        return None
    method, why = gguf_packed_method(path)
    if method is None:
        logger.info("%s: dequantizing the weights at load (%s)", path, why)
        return None
    return QuantScheme(method, 32)


def online_scheme(quantization: str | None) -> QuantScheme | None:
    """The scheme of an online ``--quantization`` (int8, fp8), None for the others."""
    if quantization not in ONLINE_QUANTIZATION:
        return None
    if jax.default_backend() == "cpu":
        logger.warning(
            "--quantization %s on CPU: the weights take a quarter of the memory, but "
            "XLA:CPU converts them in every step (batch-1 decode measured 4.4x slower "
            "than float32, bench/README.md)",
            quantization,
        )
    return QuantScheme(quantization)


ONLINE_QUANTIZATION = ("int8", "fp8")
"""``--quantization`` methods applied to a float checkpoint while it loads."""

FUSE_ENV = "JAXENGINE_FUSED_PROJECTIONS"
"""Set to ``0`` to keep q/k/v and gate/up separate everywhere (for measurement)."""


def fuse_projections(placement: Any) -> bool:
    """Whether to load the model with `TransformerConfig.fused_projections`.

    A fused ``qkv_proj``/``gate_up_proj`` is a plain row concatenation, which a
    tensor-parallel split would cut at the wrong rows, so only a placement of tensor
    size 1 fuses (pipeline stages included), or no placement (one default device).
    A placement of unknown kind (no ``parallel`` config) keeps the projections apart.
    ``$JAXENGINE_FUSED_PROJECTIONS=0`` turns fusion off.
    """
    if os.environ.get(FUSE_ENV, "1") == "0":
        return False
    if placement is None:
        return True
    parallel = getattr(placement, "parallel", None)
    return getattr(parallel, "tensor_parallel_size", None) == 1


def checkpoint_format(requested: str | None, source: ModelSource, hf_config: Any):
    """The quantized checkpoint's `CheckpointFormat` (None for a float or GGUF one);
    refuses a ``--quantization`` the checkpoint does not match. ``fp8`` is both an
    online method (a float checkpoint) and a block-fp8 checkpoint's own."""
    if requested == "gguf" and source.gguf_file is None:
        raise CheckpointError(f"{source.path}: --quantization gguf needs a .gguf model")
    if source.gguf_file is not None:
        return None
    stored = checkpoint_quantization(
        hf_config, None if requested in ONLINE_QUANTIZATION else requested
    )
    if stored is not None and requested in ONLINE_QUANTIZATION and stored.method != requested:
        raise ValueError(
            f"{source.path} is already quantized ({stored.method}): drop --quantization {requested}"
        )
    if stored is None and requested in CHECKPOINT_METHODS and requested not in ONLINE_QUANTIZATION:
        raise CheckpointError(
            f"{source.path}: --quantization {requested} needs a {requested} checkpoint "
            "(config.json has no quantization_config)"
        )
    return stored


def _checkpoint_tensors(
    source: ModelSource, load_config: LoadConfig, max_workers: int | None, packed: bool
):
    """The checkpoint's ``(hf_name, array)`` pairs, GGUF or safetensors."""
    from jaxengine.loader.gguf_io import iter_gguf
    from jaxengine.loader.safetensors_io import iter_safetensors

    load_format = load_config.load_format
    if source.gguf_file is not None:
        if load_format not in ("auto", "gguf"):
            raise CheckpointError(f"{source.gguf_file}: a GGUF file needs --load-format gguf")
        return iter_gguf(source.gguf_file, packed=packed)
    if load_format == "gguf":
        raise CheckpointError(f"{source.path}: --load-format gguf but no .gguf file found")
    return iter_safetensors(
        source.path, ignore_patterns=load_config.ignore_patterns, max_workers=max_workers
    )


def checkpoint_tensors(model_config: ModelConfig, load_config: LoadConfig, path: str | None = None):
    """The ``(hf_name, array)`` pairs of the model's checkpoint, or of the one at
    ``path`` (same architecture), as float tensors in Hugging Face's layout: what
    `LLM.reload_weights` writes into a running engine. The checkpoint is read even
    when the engine started with ``--load-format dummy``."""
    if path is not None:
        model_config = dataclasses.replace(model_config, model=str(path))
    if load_config.load_format == "dummy":
        load_config = dataclasses.replace(load_config, load_format="auto")
    source, hf_config = resolve_source(model_config, load_config)
    stored = checkpoint_format(model_config.quantization, source, hf_config)
    tensors = _checkpoint_tensors(source, load_config, None, packed=False)
    if stored is not None:
        tensors = canonical_tensors(tensors, stored, str(source.path))
    return tensors
