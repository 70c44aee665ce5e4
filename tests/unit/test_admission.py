"""Admission control (``--max-num-queued-reqs``, ``--max-num-queued-tokens``) host side.

`AdmissionControl`'s rule (the request cap with n sequences, the prefill-token
backlog, the request cap first, one count per refused request), the `StreamTable`
load it weighs (sequences, prompt tokens of sequences with no token yet, released
however a stream leaves), the output processor's first-token report that empties the
backlog whatever the output kind, the flags, and ``admission_rejections_total`` by
reason. No model, no jax; the fronts are in test_admission_fronts.py.
"""

from __future__ import annotations

import asyncio
import pickle

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxengine.config.arg_utils import FlexibleArgumentParser
from jaxengine.core.sched_output import EngineCoreOutput
from jaxengine.engine.output_processor import OutputProcessor
from jaxengine.engine_args import EngineArgs
from jaxengine.entrypoints.admission import (
    REASONS,
    AdmissionControl,
    AdmissionRejectedError,
    num_seqs,
)
from jaxengine.entrypoints.streams import Load, StreamTable
from jaxengine.metrics.loggers import PrometheusStatLogger, render_metrics
from jaxengine.pooling_params import PoolingParams
from jaxengine.sampling_params import RequestOutputKind, SamplingParams

REQS, TOKENS = REASONS


def rejected(control: AdmissionControl, load: Load, seqs: int = 1) -> str | None:
    """The reason `check` refused with (None when it admitted)."""
    try:
        control.check(load, seqs)
    except AdmissionRejectedError as e:
        return e.reason
    return None


# --------------------------------------------------------------------- the rule


def test_no_caps_admit_everything():
    control = AdmissionControl()
    assert rejected(control, Load(10**6, 10**9), seqs=1000) is None
    assert control.rejections() == {REQS: 0, TOKENS: 0}


@pytest.mark.parametrize(
    ("in_flight", "seqs", "refused"),
    [(9, 1, False), (10, 1, True), (7, 3, False), (8, 3, True), (0, 11, True)],
)
def test_request_cap_counts_the_new_request_n_times(in_flight, seqs, refused):
    control = AdmissionControl(max_num_queued_reqs=10)
    assert rejected(control, Load(in_flight, 0), seqs) == (REQS if refused else None)


@pytest.mark.parametrize(("backlog", "refused"), [(0, False), (999, False), (1000, True)])
def test_token_cap_is_on_the_backlog_the_request_joins(backlog, refused):
    control = AdmissionControl(max_num_queued_tokens=1000)
    # the new request's own prompt is not added (vLLM): 999 queued admits any prompt
    assert rejected(control, Load(1, backlog), seqs=4) == (TOKENS if refused else None)


def test_a_cap_of_zero_refuses_every_request():
    assert rejected(AdmissionControl(max_num_queued_reqs=0), Load()) == REQS
    assert rejected(AdmissionControl(max_num_queued_tokens=0), Load()) == TOKENS


def test_request_cap_is_checked_first_and_each_refusal_counts_once():
    control = AdmissionControl(max_num_queued_reqs=4, max_num_queued_tokens=100)
    assert rejected(control, Load(4, 100)) == REQS  # both over: the request cap fires
    assert rejected(control, Load(0, 100), seqs=3) == TOKENS
    assert rejected(control, Load(2, 100), seqs=4) == REQS  # n = 4: still one refusal
    assert rejected(control, Load(0, 0), seqs=4) is None
    assert control.rejections() == {REQS: 2, TOKENS: 1}


def test_the_error_names_its_cap_and_survives_pickling():
    error = AdmissionRejectedError(TOKENS)
    assert "prefill token backlog" in str(error) and "try again" in str(error).lower()
    assert "busy" in str(AdmissionRejectedError(REQS))
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), copy.reason, str(copy)) == (AdmissionRejectedError, TOKENS, str(error))


def test_negative_caps_are_refused():
    with pytest.raises(ValueError, match="max_num_queued_reqs"):
        AdmissionControl(max_num_queued_reqs=-1)


def test_pooling_requests_count_one_sequence():
    assert num_seqs(SamplingParams(n=3, temperature=1.0)) == 3
    assert num_seqs(PoolingParams()) == 1


# --------------------------------------------------------------------- the flags


def test_flags_default_to_no_cap_and_reach_the_scheduler_config():
    config = EngineArgs(model="m")._build().scheduler_config
    assert (config.max_num_queued_reqs, config.max_num_queued_tokens) == (None, None)
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--max-num-queued-reqs", "0", "--max-num-queued-tokens", "32k"])
    config = EngineArgs.from_cli_args(args)._build().scheduler_config
    control = AdmissionControl.of(config)
    assert (control.max_num_queued_reqs, control.max_num_queued_tokens) == (0, 32_000)
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-num-queued-reqs", "-1"])
    help_text = parser.format_help()
    assert "offline LLM does not" in help_text and "HTTP 503" in help_text


# --------------------------------------------------------------------- the load


def test_table_load_counts_sequences_and_prefill_tokens_until_first_tokens():
    async def run() -> None:
        table = StreamTable()
        table.open("a", seqs=2, prompt_tokens=5)
        table.open("b", owner=1, prompt_tokens=7)
        assert table.load() == Load(3, 2 * 5 + 7)
        table.prefilled(["a"])  # one of a's two sequences has its first token
        assert table.load() == Load(3, 5 + 7)
        table.prefilled(["b"], owner=0)  # another owner's report: not b's
        table.prefilled(["a", "a", "gone"])  # a has no third sequence
        assert table.load() == Load(3, 7)
        table.prefilled(["b"], owner=1)
        assert table.load() == Load(3, 0)
        table.close("a")
        assert table.load() == Load(1, 0)

    asyncio.run(run())


def test_a_stream_leaving_the_table_takes_its_load_however_it_leaves():
    async def run() -> None:
        table = StreamTable()
        table.open("closed", seqs=2, prompt_tokens=3)
        table.open("errored", prompt_tokens=4)
        table.open("failed", owner=1, seqs=3, prompt_tokens=5)
        table.close("closed")
        table.close("closed")  # idempotent: nothing taken twice
        table.deliver([("errored", ValueError("bad"))])
        assert table.load() == Load(3, 15)
        table.fail_all(RuntimeError("dead"), owner=1)
        assert table.load() == Load(0, 0)

    asyncio.run(run())


def test_each_sequence_first_token_is_reported_whatever_the_output_kind():
    processor = OutputProcessor(tokenizer=None)
    params = SamplingParams(
        n=2, temperature=1.0, max_tokens=3, output_kind=RequestOutputKind.FINAL_ONLY
    )
    processor.add("r", None, [1, 2, 3], params, arrival_time=0.0)
    emitted, _ = processor.process([EngineCoreOutput("0_r", [5])])
    assert emitted == []  # FINAL_ONLY: nothing reaches the stream yet
    assert processor.take_stats().prefilled_request_ids == ["r"]
    processor.process([EngineCoreOutput("0_r", [6]), EngineCoreOutput("1_r", [7])])
    assert processor.take_stats().prefilled_request_ids == ["r"]  # the second sequence
    processor.process([EngineCoreOutput("0_r", [6]), EngineCoreOutput("1_r", [7])])
    assert processor.take_stats().prefilled_request_ids == []


# --------------------------------------------------------------------- the metric


def counter_samples(metrics: PrometheusStatLogger) -> dict[str, dict]:
    """``*:admission_rejections_total`` samples: prefix -> {reason: (labels, value)}."""
    body, _ = render_metrics(metrics.registry)
    found: dict[str, dict] = {}
    for family in text_string_to_metric_families(body.decode()):
        if family.name.endswith(":admission_rejections"):
            assert family.type == "counter"
            prefix = family.name.split(":")[0]
            found[prefix] = {s.labels["reason"]: (s.labels, s.value) for s in family.samples}
    return found


def test_rejections_are_exposed_by_reason_from_the_start_without_engine_label():
    control = AdmissionControl(max_num_queued_reqs=1, max_num_queued_tokens=10)
    metrics = PrometheusStatLogger("model", engine_indexes=(0, 1))
    metrics.watch_admission(control.rejections)
    start = counter_samples(metrics)
    assert set(start) == {"vllm", "jaxengine"}
    for prefix in start:
        assert {reason: value for reason, (_, value) in start[prefix].items()} == {
            REQS: 0.0,
            TOKENS: 0.0,
        }
        for labels, _ in start[prefix].values():
            assert set(labels) == {"model_name", "reason"} and labels["model_name"] == "model"
    for load, seqs in [(Load(1, 0), 1), (Load(0, 0), 2), (Load(0, 10), 1)]:
        rejected(control, load, seqs)
    after = counter_samples(metrics)["vllm"]
    assert {reason: value for reason, (_, value) in after.items()} == {REQS: 2.0, TOKENS: 1.0}
