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

The config is checked before the tensors, with vLLM's checks and words
(`vllm.lora.peft_helper.PEFTHelper`, every problem in one message): its ranks (``r``,
``rank_pattern``) positive and at most ``--max-lora-rank`` even when the tensors are
smaller; no DoRA, ``lora_bias``, ``modules_to_save``, aLoRA, layer replication,
BD-LoRA, QALoRA or adapter ``bias``; and an ``init_lora_weights`` that leaves the
base weights alone: PiSSA, OLoRA, CorDA and LoftQ rewrite them when the adapter is
made (``W - B A``, or a quantized W), so their adapters only fit that rewritten base,
never the one served here.
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
# PEFT's initializations whose saved adapter loads as a plain LoRA over the untouched
# base weights (vLLM's list: LoRA-GA changes the base only while training); every
# other string is refused (`_unsupported_features`), as are the flags below
_BASE_KEEPING_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")
_REFUSED_FLAGS = (  # (adapter_config.json key, vLLM's message)
    ("use_dora", "jaxengine does not yet support DoRA."),
    ("lora_bias", "jaxengine does not support LoRA bias (lora_bias)."),
    ("alora_invocation_tokens", "jaxengine does not support Activated LoRA (aLoRA)."),
    ("layer_replication", "jaxengine does not support layer_replication."),
    ("use_bdlora", "jaxengine does not support block-diagonal LoRA (BD-LoRA)."),
    ("use_qalora", "jaxengine does not support QALoRA."),
    ("fan_in_fan_out", "jaxengine does not support fan_in_fan_out (Conv1D) adapters."),
)

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
    """``adapter_config.json``, checked for what the engine cannot serve: every
    problem named in one `LoRAAdapterError`, in vLLM's words (`PEFTHelper`)."""
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
    problems = [*_unsupported_features(config), *_rank_problems(config, max_rank)]
    if problems:
        raise LoRAAdapterError(f"{folder}: {' '.join(problems)}")
    return config


def _unsupported_features(config: dict) -> list[str]:
    """vLLM's refusals (`PEFTHelper._validate_features`, `validate_legal`), worded as
    vLLM's with this engine's name, and this engine's own (peft_type, fan_in_fan_out)."""
    problems = [message for key, message in _REFUSED_FLAGS if config.get(key)]
    peft_type = config.get("peft_type", "LORA")
    if peft_type not in ("LORA", None):
        problems.insert(0, f"jaxengine serves LoRA adapters only, not peft_type={peft_type!r}.")
    saved = config.get("modules_to_save")
    if saved:
        problems.append(
            "jaxengine only supports modules_to_save being None. "
            f"Unsupported modules_to_save: {list(saved) if isinstance(saved, list) else saved}"
        )
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in _BASE_KEEPING_INITS:
        problems.append(
            f"jaxengine does not support init_lora_weights={init!r}. Inits such as PiSSA, "
            "OLoRA, CorDA and LoftQ modify the base model weights when PEFT loads the "
            "adapter. Convert it to a regular LoRA adapter with PEFT's "
            "path_initial_model_for_weight_conversion, or set init_lora_weights to true "
            "if the served base model already contains the modified weights."
        )
    if config.get("bias", "none") not in ("none", None):
        problems.append("Adapter bias is not supported.")
    return problems


def _rank_problems(config: dict, max_rank: int) -> list[str]:
    """The config's ``r`` and ``rank_pattern`` ranks: positive, at most ``max_rank``
    (vLLM checks the largest, as here, even when the tensors are smaller)."""
    pattern = config.get("rank_pattern") or {}
    if not isinstance(pattern, dict):
        return [f"{CONFIG_FILE}: rank_pattern is not a JSON object."]
    ranks = {"r": config.get("r")} | {f"rank_pattern[{k!r}]": v for k, v in pattern.items()}
    problems = []
    for key, rank in ranks.items():
        if rank is None and key == "r":
            continue
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            problems.append(f"LoRA rank `{key}` must be a positive integer, got {rank!r}.")
    valid = [rank for rank in ranks.values() if isinstance(rank, int) and rank >= 1]
    if valid and max(valid) > max_rank:
        problems.append(
            f"LoRA rank {max(valid)} is greater than max_lora_rank {max_rank} "
            "(raise --max-lora-rank)."
        )
    return problems


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
