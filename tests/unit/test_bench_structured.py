"""`bench.throughput --structured-outputs` runs end to end on a tiny workload."""

from __future__ import annotations

import json

import pytest

from jaxengine.benchmarks import throughput
from jaxengine.benchmarks.structured import schema


@pytest.mark.slow
def test_structured_benchmark_small(smollm2_gguf, tmp_path, capsys):
    out = tmp_path / "result.json"
    kwargs = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "compile_token_buckets": [4, 32]}
    argv = ["--structured-outputs", "--model", str(smollm2_gguf), "--num-prompts", "3"]
    argv += ["--input-len", "8", "--output-len", "6", "--rounds", "1", "--json", str(out)]
    assert throughput.main([*argv, "--engine-kwargs", json.dumps(kwargs)]) == 0
    text = capsys.readouterr().out
    assert "json-schema out tok/s" in text and "schema compile" in text
    doc = json.loads(out.read_text())
    assert len(doc["compile_ms"]) == 3 and doc["ratio_mean"] > 0
    assert schema(0) != schema(1)  # one schema (one compile) per request
