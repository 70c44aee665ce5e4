"""POST /v1/decisions through the official `openai` client (``client.decisions``), on
the shared `agents_server` (the tiny random model, a ChatML template).

The model is random, so every expected probability is computed another way on the
same server: the question's chat prompt (built by the same translation, rendered by
/tokenize) followed by each label's first token, sent to /v1/completions with
``prompt_logprobs``; the softmax of those last-position logprobs over the labels is
the answer. That path reads the prompt's logits in the prefill, not the sampler's
``logprob_token_ids`` that the decision reads.
"""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from server.decisions.prompt import input_messages, question_messages
from server.decisions.protocol import parse_questions
from tests.server.conftest import MODEL
from tests.server.test_endpoints import wait_for
from tests.server.test_errors import check_error, still_serves

TICKET = "The parcel came two weeks late and the screen is cracked. I want my money back."
CHOICE = {
    "type": "choice",
    "name": "team",
    "instructions": "Which team should handle this ticket?",
    "choices": [
        {"value": "billing", "description": "Refunds and payments"},
        {"value": "shipping"},
        {"value": False, "description": "No team"},
    ],
}
PREDICATE = {"type": "predicate", "name": "damaged", "instructions": "The item is damaged."}
SCORE = {
    "type": "score",
    "instructions": "How upset is the customer?",
    "levels": [{"label": "calm"}, {"label": "annoyed"}, {"label": "furious"}],
}
ITEMS = [
    {"role": "developer", "content": "You triage support tickets."},
    {"type": "function_call", "call_id": "c1", "name": "order", "arguments": '{"id": 7}'},
    {"type": "function_call_output", "call_id": "c1", "output": "late, delivered"},
    {"role": "user", "content": [{"type": "input_text", "text": TICKET}]},
]


@pytest.fixture(scope="module")
def api(agents_server):
    return agents_server.client(max_retries=0, timeout=120)


def reference(server, items, question: dict) -> tuple[list[float], int]:
    """(the label distribution, the prompt's length) of ``question`` about ``items``,
    from /tokenize and /v1/completions' prompt_logprobs."""
    (parsed,) = parse_questions([question], False)
    messages = question_messages(input_messages(items, False), parsed)
    body = {"model": MODEL, "messages": messages, "add_special_tokens": False,
            "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    prompt = server.post("/tokenize", body).json()["tokens"]
    labels = []
    for label in parsed.labels:
        body = {"model": MODEL, "prompt": label, "add_special_tokens": False}
        labels.append(server.post("/tokenize", body).json()["tokens"][0])
    body = {"model": MODEL, "prompt": [[*prompt, t] for t in labels], "max_tokens": 1,
            "prompt_logprobs": 0, "temperature": 0}  # fmt: skip
    out = server.post("/v1/completions", body).json()
    logprobs = []
    for choice, token in zip(out["choices"], labels, strict=True):
        logprobs.append(choice["prompt_logprobs"][-1][str(token)]["logprob"])
    top = max(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]
    return [w / sum(weights) for w in weights], len(prompt)


def test_choice_probabilities_are_the_label_softmax(agents_server, api):
    decision = api.decisions.create(model=MODEL, input=TICKET, questions=[CHOICE])
    (got,) = decision.answers
    want, _ = reference(agents_server, TICKET, CHOICE)
    assert max(want) - min(want) > 1e-3  # not a uniform answer that any read would give
    probs = [p.probability for p in got.probabilities]
    assert math.fsum(probs) == pytest.approx(1.0, abs=1e-9)
    assert probs == pytest.approx(want, abs=1e-4)
    assert [p.value for p in got.probabilities] == ["billing", "shipping", False]
    best = max(range(3), key=lambda i: probs[i])
    assert got.choice == CHOICE["choices"][best]["value"] and got.confidence == probs[best]
    assert (got.type, got.name, decision.model) == ("choice", "team", MODEL)


def test_several_questions_in_one_request(agents_server, api):
    idle = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    assert wait_for(lambda: all(agents_server.metrics()[name] == 0 for name in idle))
    before = agents_server.metrics()["vllm:request_success_total"]
    questions = [PREDICATE, SCORE, CHOICE]
    decision = api.decisions.create(model="smollm2", input=ITEMS, questions=questions)
    predicate, score, choice = decision.answers
    success = "vllm:request_success_total"  # one engine request per question
    assert wait_for(lambda: agents_server.metrics()[success] - before == 3)
    refs = [reference(agents_server, ITEMS, q) for q in questions]
    assert predicate.probability == pytest.approx(refs[0][0][0], abs=1e-4)  # P(Yes)
    levels = [p.probability for p in score.probabilities]
    assert levels == pytest.approx(refs[1][0], abs=1e-4)
    assert score.score == pytest.approx(sum(i * p for i, p in enumerate(levels)), abs=1e-9)
    assert [(p.label, p.value) for p in score.probabilities] == [
        ("calm", 0), ("annoyed", 1), ("furious", 2)
    ]  # fmt: skip
    assert score.name is None and score.confidence == max(levels)
    assert [p.probability for p in choice.probabilities] == pytest.approx(refs[2][0], abs=1e-4)
    assert decision.model == "smollm2"
    usage = decision.usage
    assert usage.input_tokens == sum(n for _, n in refs) == usage.total_tokens
    assert usage.output_tokens == 0 and usage.input_tokens_details.cached_tokens >= 0


def test_same_request_same_answers(api):
    first = api.decisions.create(model=MODEL, input=TICKET, questions=[PREDICATE, CHOICE])
    again = api.decisions.create(model=MODEL, input=TICKET, questions=[PREDICATE, CHOICE])
    assert first.answers[0].probability == pytest.approx(again.answers[0].probability, abs=1e-6)
    assert first.answers[1].choice == again.answers[1].choice


BAD = [
    ({"questions": [{**PREDICATE, "type": "rank"}]}, "questions[0].type"),
    ({"questions": [{**CHOICE, "choices": []}]}, "questions[0].choices"),
    ({"questions": [PREDICATE, {**CHOICE, "name": "damaged"}]}, "questions[1].name"),
    ({"questions": [{**CHOICE, "choices": [{"value": "apple pie"}, {"value": "apple tart"}]}]},
     "questions[0].choices"),
    ({"questions": [{**PREDICATE, "instructions": [
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
     "questions[0].instructions[0]"),
    ({"input": [{"type": "function_call_output", "call_id": "x", "output": "y"}]},
     "input[0].call_id"),
    ({"input": None}, "input"),
    ({"input": "x" * 3000}, None),  # over --max-model-len 512
]  # fmt: skip


@pytest.mark.parametrize(("change", "param"), BAD)
def test_bad_requests_are_400s_and_the_server_serves(agents_server, change, param):
    body = {"model": MODEL, "input": TICKET, "questions": [PREDICATE], **change}
    body = {k: v for k, v in body.items() if v is not None}
    error = check_error(agents_server.post("/v1/decisions", body), 400)
    assert error["param"] == param, error
    still_serves(agents_server)


def test_unknown_model_missing_key_and_openapi(agents_server, api):
    assert "/v1/decisions" in agents_server.get("/openapi.json").json()["paths"]
    with pytest.raises(openai.NotFoundError):
        api.decisions.create(model="nope", input=TICKET, questions=[PREDICATE])
    body = {"model": MODEL, "input": TICKET, "questions": [PREDICATE]}
    url = agents_server.url + "/v1/decisions"
    assert httpx.post(url, json=body, timeout=60).status_code == 401
