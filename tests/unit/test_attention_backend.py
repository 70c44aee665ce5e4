"""--attention-backend picks the kernels by platform (the table in attention_backend)."""

from __future__ import annotations

import functools

import pytest

from jaxengine.runner.attention_backend import select_attention_backend, takes_attend_until
from pallas_kernels.kv_cache_update import gpu as update_gpu
from pallas_kernels.kv_cache_update import reference as update_ref
from pallas_kernels.kv_cache_update import tpu as update_tpu
from pallas_kernels.ragged_paged_attention import cpu, gpu, reference, tpu


@pytest.mark.parametrize(
    "requested, platform, name",
    [
        ("auto", "cpu", "xla-cpu"),
        ("auto", "tpu", "pallas-tpu"),
        ("auto", "gpu", "pallas-gpu"),
        ("pallas", "tpu", "pallas-tpu"),
        ("pallas", "gpu", "pallas-gpu"),
        ("pallas", "cpu", "pallas-gpu-interpret"),
        ("reference", "tpu", "reference"),
        ("reference", "gpu", "reference"),
        ("reference", "cpu", "reference"),
    ],
)
def test_table(requested, platform, name):
    assert select_attention_backend(requested, platform).name == name


def test_functions_match_their_names():
    ref = select_attention_backend("reference", "cpu")
    assert ref.attention_fn is reference.ragged_paged_attention
    assert ref.update_fn is update_ref.update_kv_cache
    on_cpu = select_attention_backend("auto", "cpu")
    assert on_cpu.attention_fn is cpu.ragged_paged_attention
    assert on_cpu.update_fn is update_ref.update_kv_cache
    on_tpu = select_attention_backend("auto", "tpu")
    assert on_tpu.attention_fn is tpu.ragged_paged_attention
    assert on_tpu.update_fn is update_tpu.update_kv_cache
    interpreted = select_attention_backend("pallas", "cpu")
    assert isinstance(interpreted.attention_fn, functools.partial)
    assert interpreted.attention_fn.func is gpu.ragged_paged_attention
    assert interpreted.attention_fn.keywords["interpret"]
    assert interpreted.update_fn.func is update_gpu.update_kv_cache
    assert select_attention_backend("pallas", "cpu").module_kwargs().keys() == {
        "attention_fn",
        "update_fn",
    }


def test_unknown_name_is_an_error():
    with pytest.raises(ValueError, match="--attention-backend 'flash'"):
        select_attention_backend("flash", "gpu")


@pytest.mark.parametrize("platform", ["tpu", "gpu", "cpu"])
@pytest.mark.parametrize("requested", ["auto", "pallas"])
def test_images_both_ways_keep_the_kernels(platform, requested, caplog):
    """Gemma 3 and 4 with images (their image tokens attend both ways): every backend's
    attention takes ``attend_until``, so the kernels stay (sized for a TPU generation
    too); an attention function without it would give way to the reference."""
    plain = select_attention_backend(requested, platform, device_kind="TPU v6 lite")
    backend = select_attention_backend(
        requested, platform, both_ways=True, device_kind="TPU v6 lite"
    )
    assert backend.name == plain.name != "reference"
    assert takes_attend_until(backend.attention_fn)
    assert "no bidirectional image attention" not in caplog.text


def test_an_attention_without_attend_until_gives_way_to_the_reference(monkeypatch, caplog):
    """A kernel that takes no ``attend_until`` (nor a wrapper's ``**kwargs``, which
    forwards it) is replaced by the reference for a both-ways model, with a warning."""
    from jaxengine.runner import attention_backend

    def causal_only(q, kv_cache, seq_lens, page_table, query_start_loc, num_seqs, *, sm_scale):
        raise AssertionError("never called")

    def forwards(*args, **kwargs):
        raise AssertionError("never called")

    for fn, name in [(forwards, "pallas-gpu"), (causal_only, "reference")]:
        backend = attention_backend.AttentionBackend("pallas-gpu", fn, fn)
        monkeypatch.setattr(attention_backend, "_select", lambda *a, b=backend: b)
        assert select_attention_backend("auto", "gpu").name == "pallas-gpu"
        assert select_attention_backend("auto", "gpu", both_ways=True).name == name
    assert "pallas-gpu has no bidirectional image attention" in caplog.text


def test_gated_delta_rule_by_platform():
    """A hybrid model's backend carries the gated delta rule by the same table: the
    reference in 16-token chunks (the CPU default) for ``reference`` and ``auto`` on
    CPU, the Mosaic kernel on TPU (sized for its generation), Triton's on GPU and
    interpreted for ``pallas`` on CPU; other models' backends carry none."""
    from jaxengine.models.layers.gated_delta import reference_rule
    from pallas_kernels.gated_delta import gpu as gdn_gpu
    from pallas_kernels.gated_delta import tpu as gdn_tpu

    def rule(requested, platform, **kwargs):
        backend = select_attention_backend(requested, platform, gated_delta=True, **kwargs)
        assert backend.module_kwargs()["gated_delta_fn"] is backend.gated_delta_fn
        return backend.gated_delta_fn

    for platform in ("cpu", "tpu", "gpu"):
        assert rule("reference", platform) is reference_rule
    assert rule("auto", "cpu") is reference_rule
    assert rule("auto", "tpu") is rule("pallas", "tpu") is gdn_tpu.gated_delta_rule
    assert rule("auto", "gpu") is rule("pallas", "gpu") is gdn_gpu.gated_delta_rule
    interpreted = rule("pallas", "cpu")
    assert interpreted.func is gdn_gpu.gated_delta_rule and interpreted.keywords["interpret"]
    sized = rule("auto", "tpu", device_kind="TPU v6 lite")
    assert sized.func is gdn_tpu.gated_delta_rule
    assert sized.keywords["vmem_limit_bytes"] == 96 * 1024 * 1024
    assert select_attention_backend("auto", "tpu").gated_delta_fn is None
    assert "gated_delta_fn" not in select_attention_backend("auto", "tpu").module_kwargs()
    with pytest.raises(ValueError, match="--attention-backend 'flash'"):
        select_attention_backend("flash", "cpu", gated_delta=True)
