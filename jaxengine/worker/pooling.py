"""Which runner a model gets (``--runner``, ``--convert``) and, for a pooling model,
its pooler (``--pooler-config``, else the model's sentence-transformers files)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from jaxengine.config import EngineConfig
from jaxengine.loader import LoadedModel
from jaxengine.runner.pooler import PoolerSettings

# the name it logged under before the worker had its own package (users filter on it)
logger = logging.getLogger("jaxengine.executor.pooling")


def is_encoder(loaded: LoadedModel) -> bool:
    """An encoder checkpoint (BertModel): bidirectional, no LM head."""
    return bool(getattr(loaded.config, "bidirectional", False))


def is_pooling_model(args: Any) -> bool:
    """Whether `EngineArgs` ``args`` serve a pooling model (`resolve_pooler`'s runner),
    told before the model loads from the flags and the checkpoint's config, so that
    the engine's defaults can fit it (`EngineArgs.create_engine_config`). False when
    the config cannot be read: loading the model then names the problem."""
    mc, load_config = args.create_model_configs()
    if mc.runner_type != "auto" or mc.convert_type in POOLING_CONVERTS:
        return _pools(mc, encoder=False, classifier=False)
    from jaxengine.loader import resolve_source
    from jaxengine.models import family_config

    try:
        _, hf_config = resolve_source(mc, load_config)
        family = family_config(hf_config, "float32")
    except Exception:  # noqa: BLE001 - any failure is reported by the load itself
        return False
    archs = getattr(hf_config, "architectures", None) or []
    classifier = any(a.endswith("ForSequenceClassification") for a in archs)
    return _pools(mc, bool(getattr(family, "bidirectional", False)), classifier)


def _pools(mc: Any, encoder: bool, classifier: bool) -> bool:
    """The runner's choice (``--runner``, else pooling for an encoder, a classifier or
    a pooling ``--convert``): whether the model pools."""
    if mc.runner_type != "auto":
        return mc.runner_type == "pooling"
    return encoder or classifier or mc.convert_type in POOLING_CONVERTS


def resolve_pooler(config: EngineConfig, loaded: LoadedModel) -> PoolerSettings | None:
    """The pooler of a pooling model, None for a generating one; refuses the
    combinations that do not run."""
    mc = config.model_config
    arch = ", ".join(getattr(loaded.hf_config, "architectures", None) or [])
    num_labels = getattr(loaded.config, "num_labels", 0)
    if "ForSequenceClassification" in arch and not hasattr(loaded.module, "classify"):
        raise NotImplementedError(f"{arch} (a classification head) is not supported yet")
    if mc.task not in (None, "auto"):
        logger.warning(
            "--task is deprecated (as in vLLM): --task %s is --runner %s --convert %s",
            mc.task, mc.runner_type, mc.convert_type,
        )  # fmt: skip
    convert = mc.convert_type
    converted = convert in POOLING_CONVERTS
    if not _pools(mc, is_encoder(loaded), bool(num_labels)):
        if is_encoder(loaded) or converted or num_labels:
            how = f"--convert {convert}" if converted else arch or "encoder"
            raise ValueError(
                f"--runner generate: {mc.model} is served as a pooling model ({how}); "
                "use --runner pooling"
            )
        return None
    _check_pooling_engine(config, loaded)
    st = sentence_transformers_pooler(loaded.source.path)
    options = mc.pooler_config or {}
    reward = convert == "reward" and not num_labels
    kind = options.get("pooling_type") or st.get("pooling_type")
    kind = str(kind or _default_pooling(loaded, reward)).upper()
    normalize = options.get("normalize", st.get("normalize", not (num_labels or reward)))
    hf = loaded.hf_config
    matryoshka = getattr(hf, "is_matryoshka", False) or getattr(hf, "matryoshka_dimensions", None)
    dims = options.get("dimensions")
    names = getattr(hf, "id2label", None) or {}
    labels = tuple(str(names.get(i, names.get(str(i), f"LABEL_{i}"))) for i in range(num_labels))
    tasks = CLASSIFY_TASKS if num_labels else REWARD_TASKS if reward else EMBED_TASKS
    return PoolerSettings(kind, bool(normalize), dims, bool(matryoshka), num_labels, labels, tasks)


POOLING_CONVERTS = ("embed", "classify", "reward")
"""``--convert`` values that make a generative checkpoint a pooling model."""
EMBED_TASKS = ("embed", "token_embed", "encode")
CLASSIFY_TASKS = ("classify", "score", "token_classify")
REWARD_TASKS = ("token_classify",)
"""The pooling tasks of each kind of pooling model, its default first (vLLM's: a
reward model returns each token's hidden state, unnormalized)."""


def _default_pooling(loaded: LoadedModel, reward: bool) -> str:
    if reward:
        return "ALL"
    return "CLS" if is_encoder(loaded) else "LAST"


def _check_pooling_engine(config: EngineConfig, loaded: LoadedModel) -> None:
    refused = {
        "--async-scheduling": config.scheduler_config.async_scheduling,
        "--speculative-config": config.speculative_config.enabled,
        "--pipeline-parallel-size > 1": config.parallel_config.pipeline_parallel_size > 1,
        "--enable-lora": config.lora_config.enable_lora,
        "--model-impl transformers": loaded.logical_axes is None,
    }
    for flag, on in refused.items():
        if on:
            raise NotImplementedError(f"{flag} with --runner pooling is not supported yet")


def sentence_transformers_pooler(folder: Any) -> dict:
    """``pooling_type`` and ``normalize`` as a sentence-transformers folder says
    (``modules.json``, the Pooling module's ``config.json``); {} without one."""
    if folder is None or not Path(folder).is_dir():
        return {}
    modules_file = Path(folder) / "modules.json"
    if not modules_file.is_file():
        return {}
    modules = json.loads(modules_file.read_text())
    kinds = [m.get("type", "") for m in modules]
    out: dict[str, Any] = {"normalize": any(k.endswith("Normalize") for k in kinds)}
    for module in modules:
        if module.get("type", "").endswith("Pooling"):
            pooling = json.loads((Path(folder) / module["path"] / "config.json").read_text())
            out["pooling_type"] = _pooling_mode(pooling)
    return out


_MODES = {
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
}


def _pooling_mode(pooling: dict) -> str:
    modes = [kind for key, kind in _MODES.items() if pooling.get(key)]
    others = [k for k, v in pooling.items() if k.startswith("pooling_mode") and v]
    others = [k for k in others if k not in _MODES]
    if len(modes) != 1 or others:
        raise NotImplementedError(
            f"sentence-transformers pooling {sorted(k for k, v in pooling.items() if v is True)} "
            "is not supported yet (one of CLS, mean or last-token pooling runs)"
        )
    return modes[0]
