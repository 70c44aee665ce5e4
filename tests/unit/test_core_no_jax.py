"""The host side never imports jax (STYLE 1): checked in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("jax", "jaxlib", "flax", "torch")


@pytest.mark.parametrize(
    "module",
    [
        "jaxengine.core",
        "jaxengine.core.scheduler",
        "jaxengine.core.kv_cache",
        "jaxengine.core.request",
        "jaxengine.core.sched_output",
        "jaxengine.core.grammar",
        "jaxengine.structured_output",
        "jaxengine.structured_output.guidance",
        "jaxengine.core.step_plan",
        "jaxengine.speculative",
        "jaxengine.speculative.verify",
        "jaxengine.speculative.ngram",
        "jaxengine.metrics.loggers",
        "jaxengine.entrypoints.admission",
        "jaxengine.core.encoder_cache",
        "jaxengine.core.spec_tokens",
        "jaxengine.multimodal.processor",
        "jaxengine.multimodal.media",
        "jaxengine.multimodal.chat",
        "jaxengine.logits_processor",
        "jaxengine.runner.logits_processors",
        "jaxengine.reasoning",
        "jaxengine.reasoning.budget",
    ],
)
def test_import_leaves_jax_out(module):
    code = (
        f"import sys, {module}\n"
        f"bad = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"importing {module} pulled in {out.stdout.strip()}"
