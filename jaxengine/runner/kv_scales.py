"""``--calculate-kv-scales``: an fp8 KV cache's per-tensor scales from the first batch.

Before the first step runs, the runner passes its batch through the model once
(`StageProgram.kv_amax`, the caches untouched) and sets each attention layer's
``k_scale`` and ``v_scale`` to the largest |k| and |v| it saw over
`layers.attention.KV_SCALE_RANGES` (vLLM's constants). The scales then stay fixed.
They are parameters of the compiled steps, not constants, so nothing recompiles.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxengine.models.layers.attention import KV_SCALE_RANGES, KV_SCALES


def with_kv_scales(params: Any, amax: Any) -> Any:
    """``params`` with every attention layer's k/v scales set from ``amax`` (the
    calibration's ``kv_amax`` tree, host or device); a layer that saw only zeros
    keeps its scales."""
    if not isinstance(params, dict):
        return params
    out = dict(params)
    found = amax.get("kv_amax") if isinstance(amax, dict) else None
    if found is not None:
        largest = np.asarray(jax.device_get(found[0]), np.float32)  # sow keeps a tuple
        for name, top, limit in zip(KV_SCALES, largest, KV_SCALE_RANGES, strict=True):
            if top > 0:
                old = params[name]
                out[name] = jax.device_put(np.float32(top / limit), old.sharding)
    for key, value in params.items():
        if isinstance(value, dict) and isinstance(amax, dict) and key in amax:
            out[key] = with_kv_scales(value, amax[key])
    return out
