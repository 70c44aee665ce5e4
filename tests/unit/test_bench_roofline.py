"""The batch-1 roofline that bench.latency measures in the same run."""

from __future__ import annotations

from jaxengine.benchmarks import latency, roofline
from jaxengine.benchmarks.common import resolve_model_files


def test_roofline_is_bandwidth_over_weight_bytes():
    roof = roofline.Roofline(weight_bytes=500_000_000, matvec_bytes_per_s=20e9)
    assert roof.tokens_per_s == 40.0
    assert roof.to_json()["matvec_gb_per_s"] == 20.0
    assert latency._of_roofline(36.0, roof) == "90%"
    assert latency._of_roofline(None, roof) == "-"


def test_matvec_times_each_weight_dtype():
    for dtype in ("float32", "bfloat16", "int8"):
        assert 0 < roofline.matvec_seconds(1 << 20, dtype, repeats=2) < 5


def test_weight_bytes_of_the_default_model(smollm2_gguf):
    weight_bytes = roofline.model_weight_bytes(resolve_model_files(str(smollm2_gguf)))
    assert weight_bytes == 4 * 134_515_008  # SmolLM2-135M, tied embeddings counted once


def test_roofline_only_at_batch_one():
    args = latency.build_parser().parse_args(["--batch-size", "2"])
    assert latency.measure_roofline(args, None) is None
    args = latency.build_parser().parse_args(["--no-roofline"])
    assert latency.measure_roofline(args, None) is None
    args = latency.build_parser().parse_args(["--roofline-dtypes", "float32,int8"])
    assert args.roofline_dtypes == ["float32", "int8"]
