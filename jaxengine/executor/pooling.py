"""Which runner a model gets (``--runner``, ``--convert``) and, for a pooling model,
its pooler (``--pooler-config``, else the model's sentence-transformers files)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jaxengine.config import EngineConfig
from jaxengine.loader import LoadedModel
from jaxengine.runner.pooler import PoolerSettings


def is_encoder(loaded: LoadedModel) -> bool:
    """An encoder checkpoint (BertModel): bidirectional, no LM head."""
    return bool(getattr(loaded.config, "bidirectional", False))


def resolve_pooler(config: EngineConfig, loaded: LoadedModel) -> PoolerSettings | None:
    """The pooler of a pooling model, None for a generating one; refuses the
    combinations that do not run."""
    mc = config.model_config
    arch = ", ".join(getattr(loaded.hf_config, "architectures", None) or [])
    num_labels = getattr(loaded.config, "num_labels", 0)
    if "ForSequenceClassification" in arch and not hasattr(loaded.module, "classify"):
        raise NotImplementedError(f"{arch} (a classification head) is not supported yet")
    runner = mc.runner
    if runner == "auto":
        pooled = is_encoder(loaded) or num_labels or mc.convert == "embed"
        runner = "pooling" if pooled else "generate"
    if runner == "generate":
        if is_encoder(loaded) or mc.convert == "embed":
            raise ValueError(
                f"--runner generate: {mc.model} is served as an embedding model "
                f"({arch or 'encoder'}{', --convert embed' if mc.convert == 'embed' else ''}); "
                "use --runner pooling"
            )
        return None
    _check_pooling_engine(config, loaded)
    st = sentence_transformers_pooler(loaded.source.path)
    options = mc.pooler_config or {}
    kind = options.get("pooling_type") or st.get("pooling_type")
    kind = str(kind or ("CLS" if is_encoder(loaded) else "LAST")).upper()
    normalize = options.get("normalize", st.get("normalize", not num_labels))
    hf = loaded.hf_config
    matryoshka = getattr(hf, "is_matryoshka", False) or getattr(hf, "matryoshka_dimensions", None)
    dims = options.get("dimensions")
    names = getattr(hf, "id2label", None) or {}
    labels = tuple(str(names.get(i, names.get(str(i), f"LABEL_{i}"))) for i in range(num_labels))
    return PoolerSettings(kind, bool(normalize), dims, bool(matryoshka), num_labels, labels)


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
