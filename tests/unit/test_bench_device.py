"""`python -m bench.device --dry-run`: every section runs on CPU and records sane values.

One dry run (tiny Llama, tiny shapes; `bench.device.profile.DRY_RUN`) in this
process, shared by the checks below, so the GPU script cannot rot between GPU windows.
"""

from __future__ import annotations

import json
import time

import pytest

from bench.device import report
from bench.device.__main__ import main
from bench.device.profile import SECTIONS
from bench.device.record import Recorder

ENGINE_ITEMS = ("startup", "decode", "trace", "baselines", "throughput", "ttft", "sync",
                "fp8_weights", "int8_weights", "fp8_kv_cache", "ngram", "lora")  # fmt: skip


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("device") / "dry.json"
    assert main(["--dry-run", "--output", str(path)]) == 0
    return json.loads(path.read_text())


def test_every_section_and_item_ran_without_error(dry_run):
    for name in SECTIONS:
        assert "error" not in dry_run[name], dry_run[name].get("error")
        for item, result in dry_run[name].items():
            if isinstance(result, dict):  # pytest's result has a count named "skipped"
                assert "error" not in result, (name, item, result)
                assert not isinstance(result.get("skipped"), str), (name, item, result)
    assert set(ENGINE_ITEMS) <= set(dry_run["engine"])
    assert dry_run["run"]["profile"] == "dry-run" and dry_run["run"]["seconds"] > 0


def test_environment_measures_the_denominators(dry_run):
    env = dry_run["environment"]
    assert env["versions"]["jax"] != "not installed"
    assert env["devices"]["backend"] == "cpu" and env["devices"]["count"] >= 1
    assert env["copy"]["copy_gb_s"] > 0 and env["matmul"]["matmul_tflop_s"] > 0
    assert env["read"]["read_gb_s"] > 0
    assert env["sheet"] is None  # no vendor's sheet for a CPU


def test_tiny_families_match_transformers(dry_run):
    section = dry_run["correctness"]
    for family in ("llama", "qwen3", "gemma3"):
        result = section[family]
        assert result["float32_match"] is True, (family, result)
        assert 0 <= result["bf16_equal_fraction"] <= 1 and 0 <= result["bf16_agreement"] <= 1
    pytest_run = section["pytest_gpu"]
    assert not pytest_run["timed_out"] and pytest_run["failed"] == pytest_run["errors"] == 0
    assert pytest_run["skipped"] >= 1  # on CPU every gpu-marked test is skipped


def test_kernels_compare_the_engine_path_with_the_reference(dry_run):
    for workload in ("decode", "prefill", "mixed"):
        result = dry_run["kernels"][workload]
        assert result["backend"] == "xla-cpu"
        assert result["max_err"] < 0.05
        assert result["engine_over_reference"] > 0
        assert result["engine"]["of_copy"] > 0 and result["engine"]["of_matmul"] > 0


def test_the_block_sweep_checks_each_config_against_the_reference(dry_run):
    """`bench.device.sweep` in interpret mode: one config per KV path, each checked."""
    for item in ("sweep_prefill", "sweep_mixed"):
        result = dry_run["kernels"][item]
        assert result["ran"] == result["planned"] == 3 and result["best"], result
        assert {row["path"] for row in result["rows"]} == {"gather", "pages", "slice"}
        for row in result["rows"]:
            assert row["ok"] and row["max_err"] < 0.05 and row["tflop_s"] > 0, row
            assert row["of_matmul"] > 0 and row["of_sheet"] is None  # no sheet for a CPU


def test_engine_figures_are_positive_and_nothing_compiles_after_warmup(dry_run):
    engine = dry_run["engine"]
    assert engine["startup"]["cold_s"] > 0 and engine["startup"]["warm_s"] > 0
    decode = engine["decode"]
    assert decode["tok_s"] > 0 and decode["mbu_read_probe"] > 0 and decode["mbu_copy_probe"] > 0
    assert decode["mbu_sheet"] is None and engine["ttft"]["mfu_sheet"] is None
    assert engine["ttft"]["mfu_matmul_probe"] > 0
    assert engine["throughput"]["out_tok_s"] > 0 and engine["ttft"]["ttft_s"] > 0
    for item in ("sync", "fp8_weights", "int8_weights", "fp8_kv_cache", "lora"):
        assert engine[item]["tok_s"] > 0 and engine[item]["over_base"] > 0, item
    assert engine["ngram"]["over_none"] > 0 and engine["ngram"]["acceptance"] is not None
    compiles = engine["compiles_after_warmup"]
    assert compiles["per_engine"]["base"] == 0 and compiles["ok"] is True


def test_the_trace_of_engine_steps_reads_into_a_table(dry_run):
    result = dry_run["engine"]["trace"]
    assert "CPU executor" in result["plane"]  # no device plane on a CPU
    assert len(result["steps"]) == result["engine_steps"] == 1 + 4  # a prefill, 4 decodes
    for phase in ("prefill", "decode"):
        assert 0 < result[phase]["busy_fraction"] <= 1 and result[phase]["top_kernels"]
    assert result["decode"]["host_gap_ms"]["median"] >= 0


def test_the_transformers_peer_runs_and_divides_the_engine(dry_run):
    peer = dry_run["peer"]
    assert peer["build"]["device"] == "cpu" and peer["build"]["compiled"] is False
    for item in ("decode", "prefill"):
        assert peer[item]["engine_over_peer"] > 0, peer[item]
    assert peer["prefill"]["prompt_len"] == dry_run["engine"]["ttft"]["prompt_len"]


def test_tables_print_every_section_and_the_goals(dry_run):
    text = report.tables(dry_run)
    for title in (*SECTIONS, "goals"):
        assert f"== {title} ==" in text
    assert "compilations after warm-up" in text and "error:" not in text
    assert "plane read: /host:CPU" in text and "transformers peer" in text


def test_an_item_that_fails_or_runs_out_of_time_is_recorded(tmp_path):
    recorder = Recorder(tmp_path / "r.json", {"test": True})
    section = recorder.section("s", budget_s=600)
    section.item("ok", lambda: {"x": 1})
    section.item("fails", lambda: 1 / 0)
    # a section of its own, begun just before its items: a failed item's garbage
    # collection (seconds in a worker holding earlier tests' engines) spends no part
    # of this budget
    timed = recorder.section("t", budget_s=2)
    timed.item("slow", lambda: time.sleep(30))  # until the section's alarm
    timed.item("late", lambda: {"never": True})
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["s"]["ok"] == {"x": 1}
    assert saved["s"]["fails"]["error"].startswith("ZeroDivisionError")
    assert saved["t"]["slow"]["error"].startswith("out of time")
    assert saved["t"]["late"] == {"skipped": "out of time"}
