"""The benchmarks' argument parsing, workload generation and tables (no model is loaded)."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

# bench/ is a top-level folder of the repository (on pytest's pythonpath), not installed.
from jaxengine.benchmarks import common, latency, throughput
from jaxengine.benchmarks.common import PeerResult


def test_throughput_defaults():
    args = throughput.build_parser().parse_args([])
    assert (args.num_prompts, args.input_len, args.output_len) == (64, 128, 128)
    assert args.backends == ["jaxengine", "jaxengine_async", "transformers", "llamacpp"]
    assert args.engine_kwargs == {} and args.hf_batch_size is None
    assert args.model == "SmolLM2-135M-Instruct"


def test_latency_defaults_are_the_batch1_decode_setup():
    args = latency.build_parser().parse_args([])
    assert (args.batch_size, args.input_len, args.output_len) == (1, 16, 128)
    assert args.num_iters_warmup == 1 and args.num_iters == 5
    assert not args.no_isolate_decode


def test_latency_flags():
    argv = ["--batch-size", "8", "--input-len", "32", "--num-iters-warmup", "0"]
    argv += ["--num-iters", "3", "--backends", "transformers,llama-cpp"]
    args = latency.build_parser().parse_args(argv)
    assert (args.batch_size, args.input_len, args.num_iters_warmup, args.num_iters) == (
        8,
        32,
        0,
        3,
    )
    assert args.backends == ["transformers", "llamacpp"]


def test_backends_parsing():
    assert common.parse_backends("all") == list(common.BACKENDS)
    assert common.parse_backends(" llamacpp , jaxengine,llamacpp") == ["llamacpp", "jaxengine"]
    with pytest.raises(argparse.ArgumentTypeError, match="vllm"):
        common.parse_backends("transformers,vllm")
    with pytest.raises(argparse.ArgumentTypeError):
        common.parse_backends(",")


def test_engine_kwargs_json():
    args = throughput.build_parser().parse_args(
        ["--engine-kwargs", '{"max-num-seqs": 16, "max_num_batched_tokens": 512}']
    )
    assert args.engine_kwargs == {"max_num_seqs": 16, "max_num_batched_tokens": 512}
    with pytest.raises(argparse.ArgumentTypeError, match="JSON object"):
        common.parse_engine_kwargs("[1, 2]")
    with pytest.raises(argparse.ArgumentTypeError, match="not valid JSON"):
        common.parse_engine_kwargs("{max_num_seqs: 16}")


def test_bad_numbers_are_rejected(capsys):
    with pytest.raises(SystemExit):
        throughput.build_parser().parse_args(["--num-prompts", "0"])
    assert "must be >= 1" in capsys.readouterr().err


def test_prompts_are_reproducible_and_drawn_from_the_pool():
    pool = np.arange(17, 1000)
    a = common.make_prompts(8, 32, pool, seed=3)
    assert a == common.make_prompts(8, 32, pool, seed=3)
    assert a != common.make_prompts(8, 32, pool, seed=4)
    assert len(a) == 8 and all(len(p) == 32 for p in a)
    flat = [t for p in a for t in p]
    assert min(flat) >= 17 and max(flat) < 1000
    assert all(type(t) is int for t in flat)
    assert len({tuple(p) for p in a}) == 8  # distinct prompts: no prefix-cache hits


def test_prompt_lengths_with_range_ratio():
    prompts = common.make_prompts(200, 100, np.arange(50), seed=0, range_ratio=0.5)
    lengths = [len(p) for p in prompts]
    assert 50 <= min(lengths) and max(lengths) <= 150 and len(set(lengths)) > 10
    with pytest.raises(ValueError):
        common.make_prompts(1, 10, np.arange(50), seed=0, range_ratio=1.0)


def test_latency_batches_fresh_per_iteration_and_series():
    args = latency.build_parser().parse_args(["--batch-size", "2", "--num-iters", "3"])
    pool = np.arange(100, 5000)
    full = latency.batches(args, pool, latency._FULL)
    one = latency.batches(args, pool, latency._ONE)
    assert len(full) == 4 and all(len(b) == 2 and len(b[0]) == 16 for b in full)
    assert len({tuple(b[0]) for b in full + one}) == 8
    assert full == latency.batches(args, pool, latency._FULL)


def test_percentiles_and_agreement():
    p = common.percentiles([1.0, 2.0, 3.0, 4.0, 5.0])
    assert list(p) == ["p10", "p25", "p50", "p75", "p90", "p99"]
    assert p["p50"] == 3.0 and p["p10"] == pytest.approx(1.4)
    assert common.agreement([[1, 2, 3, 4]], [[1, 2, 3, 4]]) == 1.0
    assert common.agreement([[1, 2, 9, 4], [5, 6, 7, 8]], [[1, 2, 3, 4], [0, 6, 7, 8]]) == 0.25
    assert common.check_outputs([[1, 2], [3]], 2) == ["1/2 outputs not 2 tokens (e.g. 1)"]


def test_table_with_ratios_and_unavailable_peers():
    results = [
        PeerResult("jaxengine", "unavailable", reason="jaxengine.LLM cannot be imported"),
        PeerResult(
            "transformers",
            "ok",
            load_s=3.0,
            metrics={"elapsed_s": 10.0, "output_tokens_per_s": 100.0},
            outputs=[[1, 2]],
        ),
        PeerResult(
            "llamacpp",
            "ok",
            load_s=0.5,
            metrics={"elapsed_s": 5.0, "output_tokens_per_s": 250.0},
            notes=["sequential: no batched API"],
            outputs=[[1, 3]],
        ),
    ]
    table = throughput.render(results).splitlines()
    assert table[0].split()[:3] == ["backend", "load", "s"]
    assert "unavailable: jaxengine.LLM cannot be imported" in table[2]
    assert "1.00x" in table[3] and "100%" in table[3]
    assert "2.50x" in table[4] and "50%" in table[4] and "sequential" in table[4]
    assert common.ratio(results, results[0], "output_tokens_per_s") == "-"
    assert "outputs" not in results[1].to_json()


def test_latency_table_prefers_decode_ratio():
    base = {"latency_p50_s": 2.0, "tokens_per_s": 64.0, "decode_tokens_per_s": 80.0}
    fast = {"latency_p50_s": 1.0, "tokens_per_s": 128.0, "decode_tokens_per_s": 240.0}
    results = [PeerResult("transformers", "ok", metrics=base), PeerResult("x", "ok", metrics=fast)]
    assert "3.00x" in latency.render(results).splitlines()[3]


def test_embed_bench_peers_by_dtype():
    from bench.embed import build_parser

    args = build_parser().parse_args(["--st-dtypes", "float32,bfloat16", "--rounds", "2"])
    assert args.st_dtypes == ["float32", "bfloat16"] and args.rounds == 2
    assert build_parser().parse_args([]).st_dtypes == ["float32"]


@pytest.mark.parametrize(
    "config_cls, extra",
    [
        ("BertConfig", {}),
        ("LlamaConfig", {"num_key_value_heads": 2}),  # grouped k/v, gated MLP
    ],
)
def test_ceiling_counts_the_models_projection_flops(config_cls, extra):
    """2 FLOPs per weight of every attention and MLP projection (torch's nn.Linear
    layers inside the layer stack), per token."""
    import torch
    import transformers

    from bench import compute_ceiling

    size = dict(hidden_size=64, intermediate_size=96, num_attention_heads=8, num_hidden_layers=3)
    config = getattr(transformers, config_cls)(vocab_size=50, **size, **extra)
    model = transformers.AutoModel.from_config(config)
    layers = model.encoder.layer if config_cls == "BertConfig" else model.layers
    weights = sum(m.weight.numel() for m in layers.modules() if isinstance(m, torch.nn.Linear))
    assert compute_ceiling.flops_per_token(config.to_dict()) == 2 * weights


def test_embed_ceiling_arithmetic_and_line():
    from bench.compute_ceiling import Ceiling
    from bench.embed import build_parser, ceiling_line

    ceilings = [
        Ceiling(
            sentences=100, tokens=2000, flops_per_token=10**7, dot_flops_per_s=rate, dtype="float32"
        )
        for rate in (1e11, 2e11)
    ]
    assert ceilings[0].sentences_per_s == pytest.approx(500.0)  # 2e10 FLOP at 1e11 FLOP/s
    # per round: 500 / 250 and 1000 / 250 (2x, 4x); 500 / 125 and 1000 / 250 (4x, 4x)
    line = ceiling_line(ceilings, {"jaxengine": [250.0, 250.0], "transformers": [125.0, 250.0]})
    assert "at 100-200 GFLOP/s" in line and "= 750.0 sentences/s" in line
    assert "jaxengine 3.00x, transformers 4.00x" in line
    assert not build_parser().parse_args([]).no_ceiling
