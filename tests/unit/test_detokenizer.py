"""Incremental detokenization equals a full decode, and stays O(window) per update."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxengine.tokenizer import IncrementalDetokenizer, get_tokenizer

TEXT = "Hello 世界! 🎉🎉 naïve café — 日本語のテキスト 👩‍👩‍👧 done."


def _stream(tok, ids, chunks, prompt=(), skip=True) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, list(prompt), skip_special_tokens=skip)
    deltas, i = [], 0
    for size in chunks:
        if i >= len(ids):
            break
        deltas.append(detok.update(ids[i : i + size], final=i + size >= len(ids)))
        i += size
    if i < len(ids):
        deltas.append(detok.update(ids[i:], final=True))
    return deltas, detok


@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_random_token_streams_equal_full_decode(smollm2_tokenizer, data, skip):
    tok = smollm2_tokenizer
    # Mostly byte-level pieces of multi-byte characters, plus any token, specials included.
    pool = st.one_of(st.integers(0, len(tok) - 1), st.sampled_from(tok.encode(TEXT)))
    ids = data.draw(st.lists(pool, max_size=40))
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=len(ids)))
    prompt = data.draw(st.sampled_from([[], tok.encode("Answer:"), tok.encode("<|im_start|>")]))
    deltas, detok = _stream(tok, ids, chunks, prompt, skip)
    expected = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == expected == detok.output_text
    assert detok.output_token_ids == ids


def test_multibyte_characters_come_out_whole(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode(TEXT)
    assert len(ids) > len(TEXT.split())  # emoji and CJK span several byte-level tokens
    deltas, _ = _stream(tok, ids, [1] * len(ids))
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas)


def test_incomplete_tail_is_held_until_final(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ok, emoji = tok.encode("ok"), tok.encode(" 🎉")
    assert len(emoji) > 1
    detok = IncrementalDetokenizer(tok)
    assert detok.update(ok) == "ok"
    assert detok.update(emoji[:-1]) == ""  # the emoji's last byte is missing
    assert detok.flush() == tok.decode(ok + emoji[:-1])[len("ok") :]  # shown as U+FFFD
    detok = IncrementalDetokenizer(tok)
    assert detok.update(ok) + detok.update(emoji[:-1]) + detok.update(emoji[-1:]) == "ok 🎉"


def test_special_tokens_skipped_or_kept(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("Hi there") + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert "".join(_stream(tok, ids, [1] * 4)[0]) == "Hi there"
    assert "".join(_stream(tok, ids, [1] * 4, skip=False)[0]) == "Hi there<|im_end|>"


def test_each_update_decodes_a_short_window(smollm2_tokenizer):
    lengths = []

    class Recording:
        def decode(self, ids, **kwargs):
            lengths.append(len(ids))
            return smollm2_tokenizer.decode(ids, **kwargs)

    ids = smollm2_tokenizer.encode("the quick brown fox jumps over the lazy dog 🎉 " * 40)
    detok = IncrementalDetokenizer(Recording(), smollm2_tokenizer.encode("prompt"))
    for t in ids:
        detok.update([t])
    assert detok.output_text == smollm2_tokenizer.decode(ids)
    assert len(ids) > 400 and max(lengths) <= 6


@pytest.mark.slow
def test_sentencepiece_byte_fallback_gemma(gemma3_gguf):
    """Gemma's tokenizer: SentencePiece pieces with ``<0xNN>`` byte fallback tokens."""
    tok = get_tokenizer(gemma3_gguf)
    ids = tok.encode(TEXT + " ̈a\u0301 \U0001f9ea", add_special_tokens=False)
    deltas, _ = _stream(tok, ids, [1] * len(ids))
    assert "".join(deltas) == tok.decode(ids)
    rng = random.Random(0)
    byte_tokens = [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "🎉é".encode()]
    for _ in range(100):
        ids = [
            rng.choice([rng.randrange(len(tok)), *byte_tokens]) for _ in range(rng.randrange(30))
        ]
        skip = rng.random() < 0.5
        deltas, _ = _stream(tok, ids, [rng.randrange(1, 4) for _ in ids], tok.encode("Q:"), skip)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip), ids
