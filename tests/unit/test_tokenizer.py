"""Tokenizer loading (folder, GGUF, override) and chat templates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxengine.tokenizer import apply_chat_template, get_tokenizer, resolve_chat_template

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi 👋, 你好?"},
]


@pytest.fixture
def tokenizer_folder(tmp_path: Path, smollm2_tokenizer) -> Path:
    """A Hugging Face folder: config.json plus the SmolLM2 tokenizer files."""
    smollm2_tokenizer.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return tmp_path


def test_gguf_tokenizer_basics(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>"
    text = "Hello 世界 🎉 ok"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert "<|im_start|>" in resolve_chat_template(tok)


def test_folder_and_override(tokenizer_folder, smollm2_tokenizer, tmp_path):
    text = "naïve café — 日本語"
    expected = smollm2_tokenizer.encode(text)
    assert get_tokenizer(tokenizer_folder).encode(text) == expected
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert get_tokenizer(bare, tokenizer=str(tokenizer_folder)).encode(text) == expected
    with pytest.raises(ValueError, match="tokenizer_mode 'mistral'"):
        get_tokenizer(tokenizer_folder, tokenizer_mode="mistral")


@pytest.mark.slow
def test_gguf_sidecar_tokenizer_equals_transformers_conversion(smollm2_gguf, smollm2_tokenizer):
    from transformers import AutoTokenizer

    get_tokenizer(smollm2_gguf)  # the second load of the session reads the sidecar
    ours = get_tokenizer(smollm2_gguf)
    direct = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    assert ours.get_vocab() == direct.get_vocab()
    assert ours.chat_template == direct.chat_template
    assert ours.all_special_tokens == direct.all_special_tokens
    for text in ("Hello world", "  spaces\tand\nlines", "<|im_start|>user\nhé 🎉<|im_end|>"):
        assert ours.encode(text) == direct.encode(text)


def test_apply_chat_template_matches_transformers(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = apply_chat_template(tok, MESSAGES)
    assert ids == tok.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    text = apply_chat_template(tok, MESSAGES, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n") and tok.decode(ids) == text
    no_prompt = apply_chat_template(tok, MESSAGES, add_generation_prompt=False, tokenize=False)
    assert text.startswith(no_prompt) and no_prompt != text


def test_continue_final_message(smollm2_tokenizer):
    partial = [*MESSAGES, {"role": "assistant", "content": "Hello! I"}]
    text = apply_chat_template(
        smollm2_tokenizer,
        partial,
        add_generation_prompt=False,
        continue_final_message=True,
        tokenize=False,
    )
    assert text.endswith("<|im_start|>assistant\nHello! I")
    with pytest.raises(ValueError, match="exclusive"):
        apply_chat_template(smollm2_tokenizer, partial, continue_final_message=True)


def test_explicit_chat_template_wins(smollm2_tokenizer, tmp_path):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    assert resolve_chat_template(smollm2_tokenizer, template) == template
    one_line = "{{ 'x' }}" * 100  # longer than any file name
    assert resolve_chat_template(smollm2_tokenizer, one_line) == one_line
    file = tmp_path / "t.jinja"
    file.write_text(template)
    assert resolve_chat_template(smollm2_tokenizer, str(file)) == template
    text = apply_chat_template(smollm2_tokenizer, MESSAGES, str(file), tokenize=False)
    assert text == "[system] Be brief.\n[user] Hi 👋, 你好?\n"
    with pytest.raises(ValueError, match="not found"):
        resolve_chat_template(smollm2_tokenizer, str(tmp_path / "missing.jinja"))


def test_missing_template_is_an_error():
    class NoTemplate:
        chat_template = None

    assert resolve_chat_template(NoTemplate()) is None
    with pytest.raises(ValueError, match="--chat-template"):
        apply_chat_template(NoTemplate(), MESSAGES)

    class Named:
        chat_template = {"default": "{{ 1 }}", "tool_use": "{{ 2 }}"}

    assert resolve_chat_template(Named()) == "{{ 1 }}"
