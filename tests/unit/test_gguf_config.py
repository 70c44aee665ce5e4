"""A GGUF file's config and tokenizer built without torch (`loader.gguf_config`) equal
what transformers builds with torch (``AutoConfig``/``AutoTokenizer`` with ``gguf_file``).

On the real files: SmolLM2 (llama, byte-level BPE, chat template) in full through
transformers' public API; Gemma 3 (gemma3, sentencepiece with merges derived from its
262k-token vocabulary) with the config through ``AutoConfig`` and the tokenizer through
the class AutoTokenizer picks, fed the same file (``GemmaTokenizer.from_pretrained(...,
gguf_file=...)``): AutoTokenizer would first rebuild the config with transformers' GGUF
reader, 11 s more for nothing compared here. On small written files: qwen2, qwen3,
qwen3moe, gemma2, and a llama file with its own output matrix named ``mistral``.

The configs' ``to_dict()`` are compared whole. Of the tokenizers' init kwargs those
that only ``from_pretrained`` records are left out: ``local_files_only`` (whether the
hub may be asked), ``added_tokens_decoder`` (tokens added beyond the file's, none
here) and the files it looked for under the class's ``vocab_files_names``
(``vocab_file``, ``merges_file``: None, a GGUF file has none of them). Everything
else is compared: the backend's whole serialization
(vocabulary, merges, normalizer, pre-tokenizer, added tokens, post-processor,
decoder), special tokens, chat template, and encodings of plain and chat texts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer
from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

from jaxengine.loader.gguf_config import gguf_hf_config, gguf_tokenizer
from tests.tiny_gguf import write_gguf

FROM_PRETRAINED_ONLY = ("local_files_only", "added_tokens_decoder")
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi 👋, 你好? What is 12*7?"},
    {"role": "assistant", "content": "84."},
    {"role": "user", "content": "Thanks!"},
]
TEXTS = [
    "Hello world",
    "  spaces\tand\nlines  ",
    "naïve café — 日本語 🎉 1234567",
    "def f(x):\n    return x ** 2\n",
]


def transformers_config(path: Path):
    return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)


def assert_same_tokenizer(ours, theirs, texts: list[str]) -> None:
    assert type(ours) is type(theirs)
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
    assert ours.get_vocab() == theirs.get_vocab() and len(ours) == len(theirs)
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert ours.all_special_ids == theirs.all_special_ids
    assert ours.chat_template == theirs.chat_template
    assert (ours.add_bos_token, ours.add_eos_token) == (theirs.add_bos_token, theirs.add_eos_token)
    skip = {*FROM_PRETRAINED_ONLY, *type(theirs).vocab_files_names}
    init = [{k: v for k, v in t.init_kwargs.items() if k not in skip} for t in (ours, theirs)]
    assert init[0] == init[1]
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids)
    if theirs.chat_template:
        for prompt in (True, False):
            kwargs = dict(add_generation_prompt=prompt, return_dict=False)
            ids = ours.apply_chat_template(MESSAGES, **kwargs)
            assert ids == theirs.apply_chat_template(MESSAGES, **kwargs)
            assert isinstance(ids, list) and ours.decode(ids) == theirs.decode(ids)


# --------------------------------------------------------------------------- real files


def test_smollm2_config_equals_transformers(smollm2_gguf):
    ours = gguf_hf_config(smollm2_gguf)
    assert ours.to_dict() == transformers_config(smollm2_gguf).to_dict()
    assert ours.model_type == "llama" and ours.tie_word_embeddings


def test_smollm2_tokenizer_equals_transformers(smollm2_gguf):
    theirs = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    ours = gguf_tokenizer(smollm2_gguf)
    assert_same_tokenizer(ours, theirs, [*TEXTS, "<|im_start|>user\nhé 🎉<|im_end|>"])
    assert ours.eos_token == "<|im_end|>" and ours.chat_template


@pytest.mark.slow
def test_gemma3_config_equals_transformers(gemma3_gguf):
    ours = gguf_hf_config(gemma3_gguf)
    assert ours.to_dict() == transformers_config(gemma3_gguf).to_dict()
    assert ours.model_type == "gemma3_text"


@pytest.mark.slow
def test_gemma3_tokenizer_equals_transformers(gemma3_gguf):
    ours = gguf_tokenizer(gemma3_gguf)
    assert type(ours).__name__ == TOKENIZER_MAPPING_NAMES["gemma3_text"]  # AutoTokenizer's pick
    theirs = type(ours).from_pretrained(gemma3_gguf.parent, gguf_file=gemma3_gguf.name)
    turn = "<start_of_turn>user\nWhy is the sea salty?<end_of_turn>\n<start_of_turn>model\n"
    assert_same_tokenizer(ours, theirs, [*TEXTS, turn, "   leading spaces"])
    assert len(ours) == 262144 and ours.bos_token == "<bos>"


# --------------------------------------------------------------------------- small files

SMALL_FILES = {
    "qwen2": {},
    "qwen3": {},
    "qwen3moe": {},
    "gemma2": {},
    "llama-mistral-untied": {"name": "mistral", "output": True},
}


@pytest.mark.parametrize("case", sorted(SMALL_FILES))
def test_small_files_equal_transformers(case, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", case.split("-")[0], **SMALL_FILES[case])
    ours = gguf_hf_config(path)
    assert ours.to_dict() == transformers_config(path).to_dict()
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert_same_tokenizer(gguf_tokenizer(path), theirs, ["abc hi!", "hi\nab", "cab <|im_end|>"])
    if case == "qwen3moe":
        assert ours.model_type == "qwen3_moe" and ours.num_experts == 4 and ours.norm_topk_prob
    if case.startswith("llama"):
        assert ours.model_type == "mistral" and not ours.tie_word_embeddings


def test_unbuilt_architecture_needs_transformers(tmp_path, monkeypatch):
    """An architecture jaxengine does not load goes to transformers' own path."""
    import transformers

    path = write_gguf(tmp_path / "m.gguf", "qwen2")
    seen = []
    monkeypatch.setattr("jaxengine.loader.gguf_config.BUILT_ARCHS", ("llama",))
    monkeypatch.setattr(
        transformers.AutoConfig, "from_pretrained", lambda *a, **k: seen.append(k) or "theirs"
    )
    assert gguf_hf_config(path) == "theirs" and seen == [{"gguf_file": "m.gguf"}]
