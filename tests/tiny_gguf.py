"""Small GGUF files written for the tests: an architecture's hyper-parameters, a
vocabulary (byte-level BPE with merges, or sentencepiece pieces with scores) and one
or two zero tensors, enough for a config and a tokenizer to be built from them."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

BYTE_LEVEL = ["!", "a", "b", "c", "h", "i", "l", "o", "e", "Ġ", "Ċ", "ab", "abc", "Ġh", "Ġhi"]
BYTE_MERGES = ["a b", "ab c", "Ġ h", "Ġh i"]
BYTE_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PIECES = ["<pad>", "<eos>", "<bos>", "<unk>", "▁", "a", "b", "c", "h", "i", "▁h", "ab", "▁hi"]
CHAT = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_level_vocab(w: gguf.GGUFWriter) -> int:
    tokens = BYTE_LEVEL + BYTE_SPECIAL
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(BYTE_LEVEL) + [3] * len(BYTE_SPECIAL))
    w.add_token_merges(BYTE_MERGES)
    w.add_bos_token_id(len(BYTE_LEVEL))
    w.add_eos_token_id(len(tokens) - 1)
    w.add_pad_token_id(len(BYTE_LEVEL))
    w.add_chat_template(CHAT)
    return len(tokens)


def _sentencepiece_vocab(w: gguf.GGUFWriter) -> int:
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(PIECES)
    w.add_token_scores([0.0] * 5 + [-float(i) for i in range(len(PIECES) - 5)])
    w.add_token_types([3, 3, 3, 2] + [1] * (len(PIECES) - 4))
    w.add_pad_token_id(0)
    w.add_eos_token_id(1)
    w.add_bos_token_id(2)
    w.add_unk_token_id(3)
    return len(PIECES)


def write_gguf(path: Path, arch: str, *, name: str = "tiny", output: bool = False) -> Path:
    """A GGUF file with ``arch``'s hyper-parameters, a vocabulary and one or two tensors."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(16)
    w.add_feed_forward_length(40)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(50000.0)
    if arch in ("qwen3moe", "gemma2"):
        w.add_key_length(8)
    if arch == "qwen3moe":
        w.add_expert_count(4)
        w.add_expert_used_count(2)
    if arch == "gemma2":
        w.add_sliding_window(64)
        vocab = _sentencepiece_vocab(w)
    else:
        vocab = _byte_level_vocab(w)
    w.add_tensor("token_embd.weight", np.zeros((vocab, 16), np.float32))
    if output:
        w.add_tensor("output.weight", np.zeros((vocab, 16), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
