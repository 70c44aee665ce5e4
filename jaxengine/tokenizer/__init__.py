"""Tokenizers: loading (folder or GGUF), chat templates, incremental detokenization."""

from jaxengine.tokenizer.chat import apply_chat_template, resolve_chat_template
from jaxengine.tokenizer.detokenizer import IncrementalDetokenizer
from jaxengine.tokenizer.loader import TOKENIZER_MODES, get_tokenizer

__all__ = [
    "TOKENIZER_MODES",
    "IncrementalDetokenizer",
    "apply_chat_template",
    "get_tokenizer",
    "resolve_chat_template",
]
