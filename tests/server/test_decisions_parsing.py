"""The Decisions API without a server: questions and input parsed (each 400 naming its
field), the question prompt, the label tokens, the probabilities read from fake engine
outputs (checked against the openai SDK's `Decision` model) and a question of more
labels than one read takes.
"""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import pydantic
import pytest
from openai.types import Decision

from jaxengine.outputs import CompletionOutput, Logprob, RequestOutput
from jaxengine.sampling_params import MAX_LOGPROB_TOKEN_IDS
from server.decisions.answers import answer, label_distribution, label_token_ids
from server.decisions.prompt import input_messages, question_messages
from server.decisions.protocol import DecisionRequest, parse_questions
from server.decisions.serving import NOT_GENERATIVE, DecisionsHandler, _decision
from server.errors import APIError, validation_message

PREDICATE = {"type": "predicate", "name": "broken", "instructions": "The item is broken."}
CHOICE = {
    "type": "choice",
    "name": "team",
    "instructions": "Route the ticket.",
    "choices": [{"value": "billing", "description": "Payments"}, {"value": True}],
}
SCORE = {
    "type": "score",
    "instructions": "How angry is the customer?",
    "levels": [{"label": "calm"}, {"label": "upset"}, {"label": "furious"}],
}
IMAGE = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}


class WordTokenizer:
    """Each word a token: its id the word's position in first-seen order (+ 10)."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        return [self.vocab.setdefault(w, 10 + len(self.vocab)) for w in text.split()]


def param_of(call, *args) -> str:
    with pytest.raises(APIError) as info:
        call(*args)
    assert info.value.status == 400
    return info.value.param


# ---------------------------------------------------------------------- questions


def test_questions_parse_to_labels_and_typed_values():
    predicate, choice, score = parse_questions([PREDICATE, CHOICE, SCORE], False)
    assert (predicate.labels, predicate.values) == (("Yes", "No"), (True, False))
    assert choice.labels == ("billing", "true") and choice.values == ("billing", True)
    assert choice.descriptions == ("Payments", None) and choice.options_field == (
        "questions[1].choices"
    )
    assert score.labels == ("calm", "upset", "furious") and score.values == (0, 1, 2)
    assert (score.name, score.index) == (None, 2)
    assert choice.instructions == [{"type": "text", "text": "Route the ticket."}]


@pytest.mark.parametrize(
    ("questions", "param"),
    [
        ([], "questions"),
        ([{**PREDICATE, "type": "rank"}], "questions[0].type"),
        ([{**CHOICE, "choices": []}], "questions[0].choices"),
        ([{**CHOICE, "choices": [{"value": "a"}]}], "questions[0].choices"),
        ([{**CHOICE, "choices": [{"value": "a"}, {"value": "a"}]}],
         "questions[0].choices[1].value"),
        ([{**CHOICE, "choices": [{"value": "a"}, {"value": 3}]}],
         "questions[0].choices[1].value"),
        ([SCORE, {**SCORE, "levels": [{"label": "x"}, {"label": "x"}]}],
         "questions[1].levels[1].label"),
        ([PREDICATE, {**CHOICE, "name": "broken"}], "questions[1].name"),
        ([{**PREDICATE, "instructions": ""}], "questions[0].instructions"),
        ([{**PREDICATE, "instructions": [{"type": "input_file"}]}], "questions[0].instructions[0]"),
        ([{**PREDICATE, "instructions": [{"type": "input_text", "text": "Is it"}, IMAGE]}],
         "questions[0].instructions[1]"),
    ],
)  # fmt: skip
def test_bad_questions_are_400s_naming_the_field(questions, param):
    assert param_of(parse_questions, questions, False) == param


def test_typed_values_are_distinct_and_images_pass_on_a_vision_model():
    choices = [{"value": "true"}, {"value": True}]  # distinct values (same label, see below)
    (q,) = parse_questions([{**CHOICE, "choices": choices}], False)
    assert q.values == ("true", True)
    with_image = {
        **PREDICATE,
        "instructions": [{"type": "input_text", "text": "Is it red?"}, IMAGE],
    }
    (q,) = parse_questions([with_image], True)
    assert q.instructions[1] == {"type": "image_url", "image_url": {"url": IMAGE["image_url"]}}


def test_missing_input_is_a_validation_error_naming_it():
    with pytest.raises(pydantic.ValidationError) as info:
        DecisionRequest(model="m", questions=[PREDICATE])
    assert validation_message(list(info.value.errors()))[1] == "input"
    with pytest.raises(pydantic.ValidationError):
        DecisionRequest(model="m", input="x", questions=[], prompt_cache_options={"ttl": "1h"})


# ---------------------------------------------------------------------- input


def test_input_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "Be strict."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Order 7:",
             "prompt_cache_breakpoint": {"mode": "explicit"}},
            {"type": "input_json", "data": {"id": 7, "state": "late"}},
        ]},
        {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{}"},
        {"type": "custom_tool_call", "call_id": "c2", "name": "grep", "input": "late"},
        {"type": "function_call_output", "call_id": "c1", "output": "shipped"},
        {"type": "custom_tool_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "none"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "It shipped."}]},
    ]  # fmt: skip
    messages = input_messages(items, False)
    assert messages[0] == {"role": "system", "content": "Be strict."}
    assert messages[1] == {"role": "user", "content": 'Order 7:{"id": 7, "state": "late"}'}
    calls = messages[2]["tool_calls"]
    assert [c["id"] for c in calls] == ["c1", "c2"] and messages[2]["role"] == "assistant"
    assert calls[1]["function"] == {"name": "grep", "arguments": "late"}
    assert messages[3:5] == [
        {"role": "tool", "tool_call_id": "c1", "content": "shipped"},
        {"role": "tool", "tool_call_id": "c2", "content": "none"},
    ]
    assert messages[5] == {"role": "assistant", "content": "It shipped."}
    assert input_messages("hello", False) == [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize(
    ("items", "param"),
    [
        ("", "input"),
        ([], "input"),
        ([{"role": "tool", "content": "x"}], "input[0].role"),
        ([{"type": "reasoning"}], "input[0].type"),
        ([{"role": "user", "content": ["x", IMAGE]}], "input[0].content[0]"),
        ([{"role": "user", "content": [{"type": "input_text", "text": "x"}, IMAGE]}],
         "input[0].content[1]"),
        ([{"role": "system", "content": [IMAGE]}], "input[0].content[0]"),
        ([{"role": "assistant", "content": [{"type": "input_text", "text": "x"}]}],
         "input[0].content[0]"),
        ([{"type": "function_call_output", "call_id": "nope", "output": "x"}], "input[0].call_id"),
        ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}],
         "input[0].arguments"),
        ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
          {"type": "function_call_output", "call_id": "c", "output": [IMAGE]}],
         "input[1].output[0]"),
    ],
)  # fmt: skip
def test_bad_input_is_a_400_naming_the_field(items, param):
    assert param_of(input_messages, items, False) == param


def test_question_joins_the_last_user_turn_or_opens_one():
    predicate, choice = parse_questions([PREDICATE, CHOICE], False)
    (user,) = question_messages([{"role": "user", "content": "It arrived."}], predicate)
    assert user["content"] == (
        "It arrived.\n\nStatement: The item is broken.\n\nIs this statement true of the "
        "input above? Answer with exactly one of these options, and nothing else:\nYes\nNo"
    )
    chat_image = {"type": "image_url", "image_url": {"url": IMAGE["image_url"]}}
    conversation = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, chat_image]},
                    {"role": "assistant", "content": "Seen."}]  # fmt: skip
    asked = question_messages(conversation, choice)
    assert asked[:2] == conversation and asked[2]["role"] == "user"
    assert asked[2]["content"].endswith("nothing else:\nbilling: Payments\ntrue")
    image_turn = question_messages(conversation[:1], choice)[0]["content"]
    assert [p["type"] for p in image_turn] == ["text", "image_url", "text"]
    assert image_turn[2]["text"].startswith("\n\nRoute the ticket.")


# ---------------------------------------------------------------------- answers


def test_labels_read_their_first_token_and_must_differ():
    tokenizer = WordTokenizer()
    pie, pear, tart = ({"value": v} for v in ("apple pie", "pear", "apple tart"))
    (q,) = parse_questions([{**CHOICE, "choices": [pie, pear]}], False)
    assert label_token_ids(q, tokenizer) == [10, 12]
    (q,) = parse_questions([{**CHOICE, "choices": [pie, tart]}], False)
    assert param_of(label_token_ids, q, tokenizer) == "questions[0].choices"


def test_answers_are_the_label_softmax_in_the_sdk_shape():
    predicate, choice, score = parse_questions([PREDICATE, CHOICE, SCORE], False)
    probs = label_distribution([math.log(0.2), math.log(0.6)])
    assert probs == pytest.approx([0.25, 0.75])
    p = label_distribution([-1.0, -1.0, -3.0])
    answers = [answer(predicate, probs), answer(choice, probs), answer(score, p)]
    assert answers[0]["probability"] == pytest.approx(0.25)
    assert answers[1]["choice"] is True and answers[1]["confidence"] == pytest.approx(0.75)
    assert answers[2]["score"] == pytest.approx(p[1] + 2 * p[2])
    assert answers[2]["probabilities"][0]["label"] == "calm" and p[0] == p[1]
    assert answers[2]["confidence"] == p[0]  # a tie goes to the first level
    usage = {"input_tokens": 3, "output_tokens": 0, "total_tokens": 3,
             "input_tokens_details": {"cache_write_tokens": 0, "cached_tokens": 0},
             "output_tokens_details": {"reasoning_tokens": 0}}  # fmt: skip
    decision = Decision.model_validate({"model": "m", "answers": answers, "usage": usage})
    assert [a.type for a in decision.answers] == ["predicate", "choice", "score"]
    assert decision.answers[1].probabilities[1].value is True


def _read_output(label_logprobs: dict[int, float], n_prompt: int, cached: int) -> RequestOutput:
    entry = {t: Logprob(lp) for t, lp in label_logprobs.items()}
    seq = CompletionOutput(0, "x", [5], None, [entry], "length")
    return RequestOutput("r", None, list(range(n_prompt)), None, [seq], True,
                         num_cached_tokens=cached)  # fmt: skip


def test_a_question_of_many_labels_is_read_in_slices_that_join():
    tokenizer = WordTokenizer()
    many = [{"value": f"v{k}"} for k in range(200)]
    questions = parse_questions([PREDICATE, {**CHOICE, "choices": many}], False)
    ids = [label_token_ids(q, tokenizer) for q in questions]
    handler = DecisionsHandler(SimpleNamespace(), None)
    reads = handler._reads("m", [{"role": "user", "content": "hi"}], questions, ids)
    assert [len(r.logprob_token_ids) for r in reads] == [2, MAX_LOGPROB_TOKEN_IDS, 72]
    assert reads[0].max_tokens == 1 and reads[0].temperature == 0.0
    assert reads[1].request_id.endswith("-1-0") and reads[2].request_id.endswith("-1-1")
    logprobs = {t: -0.01 * k for k, t in enumerate(ids[1])}
    outputs = [
        _read_output({ids[0][0]: -1.0, ids[0][1]: -2.0}, 10, 0),
        _read_output({t: logprobs[t] for t in reads[1].logprob_token_ids}, 12, 8),
        _read_output({t: logprobs[t] for t in reads[2].logprob_token_ids}, 12, 8),
    ]
    decision = _decision("m", questions, ids, outputs)
    want = label_distribution(list(logprobs.values()))
    got = [p["probability"] for p in decision["answers"][1]["probabilities"]]
    assert got == pytest.approx(want) and decision["answers"][1]["choice"] == "v0"
    assert decision["answers"][0]["probability"] == pytest.approx(1 / (1 + math.exp(-1)))
    assert decision["usage"]["input_tokens"] == 34
    assert decision["usage"]["input_tokens_details"]["cached_tokens"] == 16


def test_a_pooling_model_serves_no_decisions():
    ctx = SimpleNamespace(engine=SimpleNamespace(pooler=object()))
    request = DecisionRequest(model="m", input="x", questions=[PREDICATE])
    with pytest.raises(APIError) as info:
        asyncio.run(DecisionsHandler(ctx, None).create(request))
    assert (info.value.status, info.value.param) == (400, "model")
    assert info.value.message == NOT_GENERATIVE
