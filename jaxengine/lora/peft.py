"""Reading a PEFT LoRA adapter folder into per-module A and B arrays (host, numpy).

A folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` with
``base_model.model.<module>.lora_A.weight [r, in]`` and ``.lora_B.weight [out, r]``
per target module. `read_adapter` checks every part against the model's projections
(`models.layers.lora.target_shapes`) and ``--max-lora-rank``, folds the scaling into B
(``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA; per-module ``rank_pattern``
and ``alpha_pattern`` honoured) and pads the rank with zeros to the slot rank. Fused
modules (``qkv_proj``, ``gate_up_proj``) are split: their B rows go to q/k/v (or
gate/up), each with the shared A. Anything it cannot serve is a `LoRAAdapterError`
(a `LoRAAdapterNotFoundError` when the folder holds no ``adapter_config.json``).

The config is checked before the tensors: its ranks (``r``, ``rank_pattern``) against
``--max-lora-rank`` even when the tensors are smaller (as vLLM does), and its
``init_lora_weights``: PiSSA, OLoRA, CorDA, LoftQ and LoRA-GA rewrite the base
model's weights when the adapter is made (``W - B A``, or a quantized W), so their
adapters only fit that rewritten base, never the one served here.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from jaxengine.lora.request import LoRAAdapterError, LoRAAdapterNotFoundError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_TENSOR = re.compile(r"^(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[\w-]+)?\.weight$")
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# PEFT's initializations that leave the base weights alone (B A = 0 at the start, or
# random A and B over the untouched W); every other one is refused (`_check_init`)
_BASE_KEEPING_INITS = ("gaussian", "eva", "orthogonal", "mica")

Weights = dict[str, tuple[np.ndarray, np.ndarray]]  # module -> (A [R, in], B [out, R])


def read_adapter(
    path: str | Path, targets: Mapping[str, tuple[int, int]], max_rank: int
) -> Weights:
    """The adapter at ``path`` as float32 ``(A [max_rank, in], B [out, max_rank])`` per
    module of ``targets`` (module name -> weight ``(out, in)``) it adapts, scaling
    folded into B. Raises `LoRAAdapterError` naming the problem."""
    folder = Path(path)
    config = read_config(folder, max_rank)
    pairs = _pairs(_tensors(folder), folder)
    weights: Weights = {}
    for module, (a, b) in pairs.items():
        rank = a.shape[0]
        if rank > max_rank:
            raise LoRAAdapterError(
                f"{folder}: LoRA rank {rank} of {module} is greater than max_lora_rank "
                f"{max_rank} (raise --max-lora-rank)"
            )
        if b.ndim != 2 or b.shape[1] != rank:
            raise LoRAAdapterError(
                f"{folder}: {module}: lora_B of shape {b.shape} does not match lora_A {a.shape}"
            )
        b = b * _scaling(config, module, rank)
        for name, part_b in _split_fused(module, b, targets, folder).items():
            _check_shape(folder, name, a, part_b, targets[name])
            weights[name] = (_pad(a, max_rank, 0), _pad(part_b, max_rank, 1))
    if not weights:
        raise LoRAAdapterError(f"{folder}: the adapter has no LoRA weights")
    return weights


def read_config(folder: Path, max_rank: int) -> dict:
    """``adapter_config.json``, checked for what the engine cannot serve."""
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise LoRAAdapterNotFoundError(
            f"{folder}: no {CONFIG_FILE} (not a PEFT adapter folder)"
        ) from None
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"{folder}/{CONFIG_FILE}: cannot read: {e}") from e
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{folder}/{CONFIG_FILE}: not a JSON object")
    refused = {
        "peft_type": config.get("peft_type", "LORA") not in ("LORA", None),
        "bias": config.get("bias", "none") not in ("none", None),
        "use_dora": bool(config.get("use_dora")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "modules_to_save": bool(config.get("modules_to_save")),
    }
    bad = [key for key, is_bad in refused.items() if is_bad]
    if bad:
        shown = ", ".join(f"{k}={config.get(k)!r}" for k in bad)
        raise LoRAAdapterError(f"{folder}: adapter setting not supported: {shown}")
    _check_init(folder, config.get("init_lora_weights", True))
    _check_ranks(folder, config, max_rank)
    return config


def _check_init(folder: Path, init) -> None:
    """Refuses an ``init_lora_weights`` that rewrites the base model's weights."""
    if init is None or isinstance(init, bool):
        return
    if isinstance(init, str) and init.lower() in _BASE_KEEPING_INITS:
        return
    raise LoRAAdapterError(
        f"{folder}: adapter setting not supported: init_lora_weights={init!r} (the engine "
        "serves the base model's weights unchanged, so it serves only adapters made over "
        f"them: init_lora_weights true, false or one of {', '.join(_BASE_KEEPING_INITS)}; "
        "PiSSA, OLoRA, CorDA, LoftQ and LoRA-GA rewrite them when the adapter is made: "
        "save such an adapter with PEFT's save_pretrained(path_initial_model_for_weight_"
        "conversion=...) to make a plain LoRA of it)"
    )


def _check_ranks(folder: Path, config: dict, max_rank: int) -> None:
    """The config's ``r`` and ``rank_pattern`` ranks, each at most ``max_rank``."""
    pattern = config.get("rank_pattern") or {}
    if not isinstance(pattern, dict):
        raise LoRAAdapterError(f"{folder}/{CONFIG_FILE}: rank_pattern is not a JSON object")
    ranks = {"r": config.get("r")} | {f"rank_pattern[{k!r}]": v for k, v in pattern.items()}
    for key, rank in ranks.items():
        if rank is None and key == "r":
            continue
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise LoRAAdapterError(f"{folder}/{CONFIG_FILE}: {key} is not a rank: {rank!r}")
        if rank > max_rank:
            raise LoRAAdapterError(
                f"{folder}: LoRA rank {rank} is greater than max_lora_rank {max_rank} "
                f"({key} in {CONFIG_FILE}; raise --max-lora-rank)"
            )


def _tensors(folder: Path):
    from jaxengine.loader.errors import CheckpointError
    from jaxengine.loader.safetensors_io import iter_safetensors

    file = folder / WEIGHTS_FILE
    if not file.is_file():
        found = ", ".join(sorted(p.name for p in folder.glob("adapter_model*"))) or "none"
        raise LoRAAdapterError(f"{folder}: no {WEIGHTS_FILE} (found: {found})")
    try:
        return [(name, np.asarray(t, np.float32)) for name, t in iter_safetensors(file)]
    except CheckpointError as e:
        raise LoRAAdapterError(f"{folder}: corrupt adapter weights: {e}") from e


def _pairs(tensors, folder: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``module -> (A, B)``; every tensor must be a LoRA A or B of some module."""
    parts: dict[str, dict[str, np.ndarray]] = {}
    for name, array in tensors:
        match = _TENSOR.match(name.removeprefix(_PREFIX))
        if match is None or array.ndim != 2:
            raise LoRAAdapterError(f"{folder}: tensor {name!r} is not a LoRA A or B weight")
        parts.setdefault(match["module"], {})[match["part"]] = array
    for module, ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"{folder}: {module} has lora_{''.join(ab)} only")
    return {module: (ab["A"], ab["B"]) for module, ab in parts.items()}


def _scaling(config: dict, module: str, rank: int) -> float:
    alpha = config.get("lora_alpha", rank)
    for key, value in (config.get("alpha_pattern") or {}).items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            alpha = value
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _split_fused(module: str, b: np.ndarray, targets: Mapping, folder: Path) -> dict:
    """``{module: B}``, or a fused module's B split by rows into its projections."""
    parent, _, leaf = module.rpartition(".")
    if module in targets:
        return {module: b}
    if leaf in _FUSED:
        names = [f"{parent}.{p}" for p in _FUSED[leaf]]
        if all(n in targets for n in names):
            sizes = [targets[n][0] for n in names]
            if sum(sizes) == b.shape[0]:
                return dict(zip(names, np.split(b, np.cumsum(sizes)[:-1]), strict=True))
            raise LoRAAdapterError(
                f"{folder}: {module}: lora_B has {b.shape[0]} rows, the model's "
                f"{'/'.join(_FUSED[leaf])} have {sum(sizes)}"
            )
    raise LoRAAdapterError(
        f"{folder}: module {module!r} cannot carry an adapter (supported: the attention "
        "and MLP projections q/k/v/o_proj, gate/up/down_proj of each decoder layer)"
    )


def _check_shape(folder: Path, name: str, a: np.ndarray, b: np.ndarray, target) -> None:
    out, inp = target
    if a.shape[1] != inp or b.shape[0] != out:
        raise LoRAAdapterError(
            f"{folder}: {name}: lora_A {a.shape} and lora_B {b.shape} do not fit the "
            f"model's weight of [out={out}, in={inp}] (an adapter for another model?)"
        )


def _pad(x: np.ndarray, rank: int, axis: int) -> np.ndarray:
    widths = [(0, 0), (0, 0)]
    widths[axis] = (0, rank - x.shape[axis])
    return np.pad(x, widths)
