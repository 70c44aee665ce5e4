"""Structured outputs through `LLM` on the real default model (SmolLM2-135M-Instruct).

The shared small engine has a tiny KV cache (preemption by recompute happens) and a
32-token budget (prompts are chunked), so constrained requests run through chunked
prefill, preemption and mixed batches beside free ones, at temperature 1.0 over seeds.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from jaxengine import SamplingParams, StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "point": {
            "type": "object",
            "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
            "required": ["x", "y"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["city", "point", "tags"],
    "additionalProperties": False,
}
GRAMMAR = """
root ::= "(" num (op num)* ")"
op ::= "+" | "*"
num ::= [1-9] [0-9]?
"""
GRAMMAR_RE = re.compile(r"\((?:[1-9][0-9]?)(?:[+*][1-9][0-9]?)*\)")


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def constrained(seed: int, **constraint) -> SamplingParams:
    return SamplingParams(
        temperature=1.0,
        seed=seed,
        max_tokens=70,
        structured_outputs=StructuredOutputsParams(disable_any_whitespace=True, **constraint),
    )


@pytest.mark.slow
def test_constraints_hold_at_temperature_one_beside_free_requests(small_llm):
    cases = []  # (messages, params, check)
    for seed in range(4):  # long free requests first fill the small cache: preemption
        free = SamplingParams(temperature=1.0, seed=seed, max_tokens=90, logprobs=2)
        free.ignore_eos = True
        cases.append((chat(f"Tell me story number {seed}."), free, None))
    for seed in range(3):
        for schema in (PERSON, NESTED):
            cases.append(
                (chat("Reply in JSON."), constrained(seed, json=schema), _schema_check(schema))
            )
        cases.append(
            (chat("A code?"), constrained(seed, regex=r"[A-Z]{2}-[0-9]{2,4}"), _regex_check())
        )
        cases.append((chat("Pick one."), constrained(seed, choice=["red", "green"]), _choice))
        cases.append((chat("Some math:"), constrained(seed, grammar=GRAMMAR), _grammar))
    stats = small_llm.engine.get_stats()
    outs = small_llm.chat([c[0] for c in cases], [c[1] for c in cases], use_tqdm=False)
    for (_, _, check), out in zip(cases, outs, strict=True):
        seq = out.outputs[0]
        if check is not None:
            assert seq.finish_reason == "stop", seq
            check(seq.text)
        else:
            assert len(seq.logprobs) == len(seq.token_ids)
    assert small_llm.engine.get_stats().num_preemptions > stats.num_preemptions


def _schema_check(schema):
    return lambda text: jsonschema.validate(json.loads(text), schema)


def _regex_check():
    return lambda text: re.fullmatch(r"[A-Z]{2}-[0-9]{2,4}", text) or pytest.fail(text)


def _choice(text: str) -> None:
    assert text in ("red", "green")


def _grammar(text: str) -> None:
    assert GRAMMAR_RE.fullmatch(text), text


@pytest.mark.slow
def test_with_n_logprobs_penalties_and_stop_strings(small_llm):
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4}
    params = SamplingParams(
        temperature=0.9,
        n=3,
        seed=7,
        logprobs=3,
        presence_penalty=0.5,
        repetition_penalty=1.1,
        max_tokens=40,
        structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True),
    )
    (out,) = small_llm.chat(chat("Some numbers in JSON."), params, use_tqdm=False)
    assert len(out.outputs) == 3
    for seq in out.outputs:
        jsonschema.validate(json.loads(seq.text), schema)
        assert len(seq.logprobs) == len(seq.token_ids)
        # the mask applies before logprobs (as vLLM): the sampled token is never -inf
        assert all(
            lp[t].logprob > float("-inf") for t, lp in zip(seq.token_ids, seq.logprobs, strict=True)
        )
    stop = SamplingParams(
        temperature=0,
        max_tokens=40,
        stop=[","],
        structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True),
    )
    (out,) = small_llm.chat(chat("Some numbers in JSON."), stop, use_tqdm=False)
    assert out.outputs[0].text.startswith("[") and "," not in out.outputs[0].text


def test_json_object_and_greedy_repeatable(small_llm):
    params = SamplingParams(
        temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json_object=True)
    )
    first, second = small_llm.chat([chat("A JSON object about cats.")] * 2, params, use_tqdm=False)
    assert first.outputs[0].text == second.outputs[0].text
    if first.outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(first.outputs[0].text), dict)
    else:
        assert first.outputs[0].text.lstrip().startswith("{")


@pytest.mark.parametrize(
    "constraint, named",
    [
        (dict(json={"type": "objekt"}), "structured_outputs.json"),
        (dict(json="{not json"), "structured_outputs.json"),
        (dict(regex="(("), "structured_outputs.regex"),
        (dict(grammar="start: undefined_rule"), "structured_outputs.grammar"),
        (dict(grammar='root ::= "a'), "structured_outputs.grammar"),
        (dict(structural_tag="{}"), "structured_outputs.structural_tag"),
    ],
)
def test_bad_constraints_are_refused_before_queueing(small_llm, constraint, named):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(ValueError, match=re.escape(named)):
        small_llm.generate(["hello"], params, use_tqdm=False)
    assert not small_llm.engine.has_unfinished_requests()


class _EndsAtToken:
    """A reasoning parser whose reasoning ends at one token (SmolLM2 has no think
    markers): the engine must leave the output free until then, then constrain it."""

    def __init__(self, end: int) -> None:
        self.end = end

    def is_reasoning_end(self, ids) -> bool:
        return self.end in ids

    def content_token_ids(self, ids) -> list[int]:
        ids = list(ids)
        return ids[ids.index(self.end) + 1 :] if self.end in ids else []


def test_constraint_starts_after_reasoning(small_llm, monkeypatch):
    tokenizer = small_llm.get_tokenizer()
    (end,) = tokenizer.encode(".", add_special_tokens=False)
    monkeypatch.setattr(small_llm.engine.structured_outputs, "reasoner", _EndsAtToken(end))
    params = SamplingParams(
        temperature=0,
        max_tokens=60,
        structured_outputs=StructuredOutputsParams(regex="[0-9]{3}"),
    )
    # no "." in the prompt: a prompt that closes the reasoning would constrain at once
    (out,) = small_llm.chat(chat("Describe the sea in one sentence"), params, use_tqdm=False)
    seq = out.outputs[0]
    reasoning, _, answer = tokenizer.decode(seq.token_ids).partition(".")
    assert reasoning and not reasoning.isdigit()  # free text first
    assert re.fullmatch(r"[0-9]{3}(<\|im_end\|>)?", answer), seq.text
    assert seq.finish_reason == "stop"
