"""Output classes: vLLM-shaped fields, merging of streamed outputs, logprob dicts."""

from __future__ import annotations

from jaxengine.outputs import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    logprobs_dict,
)


def _completion(index: int, text: str, ids: list[int], finish: str | None = None):
    lps = [{t: Logprob(-1.0, 1)} for t in ids]
    return CompletionOutput(index, text, ids, -1.0 * len(ids), lps, finish_reason=finish)


def test_vllm_style_access_and_repr() -> None:
    out = RequestOutput(
        request_id="0",
        prompt="Hi",
        prompt_token_ids=[1, 2],
        prompt_logprobs=None,
        outputs=[_completion(0, " there", [3, 4], "length")],
        finished=True,
        metrics=RequestMetrics(arrival_time=1.0, first_token_time=1.5, finished_time=3.0),
        num_cached_tokens=0,
    )
    assert out.outputs[0].text == " there" and out.outputs[0].finished()
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].stop_reason is None
    assert out.metrics.time_to_first_token == 0.5 and out.metrics.e2e_latency == 2.0
    r = repr(out)
    assert r.startswith("RequestOutput(request_id=0, prompt='Hi'") and "text=' there'" in r
    assert not _completion(0, "", []).finished()


def test_add_aggregates_deltas_or_replaces() -> None:
    def req(*completions, finished=False):
        return RequestOutput("r", "p", [1], None, list(completions), finished)

    acc = req(_completion(0, "a", [1]))
    acc.add(req(_completion(1, "x", [9])), aggregate=True)
    acc.add(req(_completion(0, "b", [2], "stop"), finished=True), aggregate=True)
    assert acc.finished
    first, second = acc.outputs
    assert (first.text, list(first.token_ids), first.finish_reason) == ("ab", [1, 2], "stop")
    assert len(first.logprobs) == 2 and first.cumulative_logprob == -1.0
    assert (second.index, second.text) == (1, "x")

    acc.add(req(_completion(0, "new", [5])), aggregate=False)
    assert acc.outputs[0].text == "new"


def test_logprobs_dict_puts_sampled_first() -> None:
    d = logprobs_dict(7, -2.5, 3, [4, 5, 7], [-0.1, -1.0, -2.5])
    assert list(d) == [7, 4, 5]
    assert d[7] == Logprob(-2.5, 3) and d[4].rank == 1 and d[5].rank == 2
