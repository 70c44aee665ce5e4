"""GGUF reading on small files written with `gguf.GGUFWriter`: names, layouts, values."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from jaxengine.loader.errors import CheckpointError
from jaxengine.loader.gguf_io import (
    gguf_metadata,
    gguf_packed_method,
    hf_name_map,
    iter_gguf,
    read_gguf_header,
)
from jaxengine.models.layers.quant import QuantScheme, dequantize

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 64, 4, 2, 16, 128, 96


def _write(path: Path, arch: str, tensors: dict, metadata: dict | None = None) -> Path:
    """Writes ``{gguf_name: (float32 array, qtype)}``, each quantized to its type."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    for key, value in (metadata or {}).items():
        if isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_uint32(key, value)
    for name, (array, qtype) in tensors.items():
        if qtype == Q.F32:
            writer.add_tensor(name, array.astype(np.float32))
        elif qtype == Q.F16:
            writer.add_tensor(name, array.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's conversion of Q/K rows (rotary halves -> interleaved pairs)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _dequantized(array: np.ndarray, qtype: Q) -> np.ndarray:
    """What ``gguf`` itself gives back for ``array`` stored as ``qtype``."""
    if qtype in (Q.F32, Q.F16):
        return array.astype(np.float16 if qtype == Q.F16 else np.float32).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype)


def _rand(rng, *shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


@pytest.fixture
def tiny_llama(tmp_path: Path):
    """A 2-layer llama GGUF in mixed types, and the HF tensors it must load as."""
    rng = np.random.default_rng(0)
    q_dim, kv_dim = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    tensors, expected = {}, {}

    def add(gguf_name, hf_name, array, qtype, permute_heads=None):
        stored = _llamacpp_permute(array, permute_heads) if permute_heads else array
        tensors[gguf_name] = (stored, qtype)
        value = _dequantized(stored, qtype)
        if permute_heads and qtype != Q.F32:  # compare with the quantized, unpermuted values
            value = _unpermute_by_index(value, permute_heads)
        expected[hf_name] = array if qtype == Q.F32 else value

    add("token_embd.weight", "model.embed_tokens.weight", _rand(rng, VOCAB, HIDDEN), Q.Q8_0)
    add("output_norm.weight", "model.norm.weight", _rand(rng, HIDDEN), Q.F32)
    types = [
        (Q.F32, Q.F16, Q.BF16, Q.Q4_1, Q.Q8_0, Q.Q4_0),
        (Q.Q4_1, Q.Q8_0, Q.Q4_1, Q.Q8_0, Q.F16, Q.Q5_0),
    ]
    for b, (tq, tv, to, tg, tu, td) in enumerate(types):
        pre, hf = f"blk.{b}.", f"model.layers.{b}."
        add(
            pre + "attn_q.weight",
            hf + "self_attn.q_proj.weight",
            _rand(rng, q_dim, HIDDEN),
            tq,
            HEADS,
        )
        add(
            pre + "attn_k.weight",
            hf + "self_attn.k_proj.weight",
            _rand(rng, kv_dim, HIDDEN),
            tq,
            KV_HEADS,
        )
        add(pre + "attn_v.weight", hf + "self_attn.v_proj.weight", _rand(rng, kv_dim, HIDDEN), tv)
        add(
            pre + "attn_output.weight",
            hf + "self_attn.o_proj.weight",
            _rand(rng, HIDDEN, q_dim),
            to,
        )
        add(pre + "ffn_gate.weight", hf + "mlp.gate_proj.weight", _rand(rng, INTER, HIDDEN), tg)
        add(pre + "ffn_up.weight", hf + "mlp.up_proj.weight", _rand(rng, INTER, HIDDEN), tu)
        add(pre + "ffn_down.weight", hf + "mlp.down_proj.weight", _rand(rng, HIDDEN, INTER), td)
        add(pre + "attn_norm.weight", hf + "input_layernorm.weight", _rand(rng, HIDDEN), Q.F32)
        add(
            pre + "ffn_norm.weight",
            hf + "post_attention_layernorm.weight",
            _rand(rng, HIDDEN),
            Q.F32,
        )
    return tmp_path, tensors, expected


def _unpermute_by_index(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `_llamacpp_permute`, written with explicit row indices."""
    d = w.shape[0] // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        for i in range(d // 2):
            for half in range(2):
                out[h * d + half * (d // 2) + i] = w[h * d + 2 * i + half]
    return out


@pytest.mark.parametrize("tied", [True, False])
def test_llama_tensors_match_gguf_dequantize(tiny_llama, tied):
    tmp_path, tensors, expected = tiny_llama
    if not tied:
        lm_head = _rand(np.random.default_rng(1), VOCAB, HIDDEN)
        tensors = {**tensors, "output.weight": (lm_head, Q.Q4_1)}
        expected = {**expected, "lm_head.weight": _dequantized(lm_head, Q.Q4_1)}
    path = _write(tmp_path / "tiny.gguf", "llama", tensors)
    got = dict(iter_gguf(path))
    assert sorted(got) == sorted(expected)  # no lm_head.weight is made up when tied
    for name, value in expected.items():
        assert got[name].dtype == np.float32 and got[name].flags.writeable, name
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_qwen3moe_experts_come_out_per_expert(tmp_path):
    rng = np.random.default_rng(2)
    n_exp, moe_inter = 4, 32
    gate, up = _rand(rng, n_exp, moe_inter, HIDDEN), _rand(rng, n_exp, moe_inter, HIDDEN)
    down, router = _rand(rng, n_exp, HIDDEN, moe_inter), _rand(rng, n_exp, HIDDEN)
    q = _rand(rng, HEADS * HEAD_DIM, HIDDEN)
    tensors = {
        "blk.0.ffn_gate_exps.weight": (gate, Q.Q8_0),
        "blk.0.ffn_up_exps.weight": (up, Q.F32),
        "blk.0.ffn_down_exps.weight": (down, Q.F16),
        "blk.0.ffn_gate_inp.weight": (router, Q.F32),
        "blk.0.attn_q.weight": (q, Q.F32),
        "blk.0.attn_q_norm.weight": (_rand(rng, HEAD_DIM), Q.F32),
    }
    got = dict(iter_gguf(_write(tmp_path / "moe.gguf", "qwen3moe", tensors)))
    np.testing.assert_array_equal(got["model.layers.0.self_attn.q_proj.weight"], q)  # no permute
    np.testing.assert_array_equal(got["model.layers.0.mlp.gate.weight"], router)
    assert "model.layers.0.self_attn.q_norm.weight" in got
    gate_q = _dequantized(gate, Q.Q8_0)
    for e in range(n_exp):
        prefix = f"model.layers.0.mlp.experts.{e}."
        np.testing.assert_array_equal(got[prefix + "gate_proj.weight"], gate_q[e])
        np.testing.assert_array_equal(got[prefix + "up_proj.weight"], up[e])
        np.testing.assert_array_equal(
            got[prefix + "down_proj.weight"], _dequantized(down[e], Q.F16)
        )
    assert len(got) == 3 + 3 * n_exp


def test_qwen2_biases_and_untouched_qk(tmp_path):
    rng = np.random.default_rng(4)
    q, q_bias, k_bias = _rand(rng, HEADS * HEAD_DIM, HIDDEN), _rand(rng, 64), _rand(rng, 32)
    tensors = {
        "blk.1.attn_q.weight": (q, Q.F32),
        "blk.1.attn_q.bias": (q_bias, Q.F32),
        "blk.1.attn_k.bias": (k_bias, Q.F32),
        "output.weight": (_rand(rng, VOCAB, HIDDEN), Q.F32),
    }
    got = dict(iter_gguf(_write(tmp_path / "q2.gguf", "qwen2", tensors)))
    np.testing.assert_array_equal(got["model.layers.1.self_attn.q_proj.weight"], q)
    np.testing.assert_array_equal(got["model.layers.1.self_attn.q_proj.bias"], q_bias)
    np.testing.assert_array_equal(got["model.layers.1.self_attn.k_proj.bias"], k_bias)
    assert "lm_head.weight" in got


def test_gemma3_norms_lose_the_stored_one(tmp_path):
    rng = np.random.default_rng(3)
    names = {
        "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
        "blk.0.post_attention_norm.weight": "model.layers.0.post_attention_layernorm.weight",
        "blk.0.ffn_norm.weight": "model.layers.0.pre_feedforward_layernorm.weight",
        "blk.0.post_ffw_norm.weight": "model.layers.0.post_feedforward_layernorm.weight",
        "blk.0.attn_k_norm.weight": "model.layers.0.self_attn.k_norm.weight",
        "output_norm.weight": "model.norm.weight",
    }
    tensors = {n: (_rand(rng, HIDDEN), Q.F32) for n in names}
    tensors["blk.0.attn_k.weight"] = (_rand(rng, KV_HEADS * HEAD_DIM, HIDDEN), Q.F32)
    got = dict(iter_gguf(_write(tmp_path / "g.gguf", "gemma3", tensors)))
    for gguf_name, hf_name in names.items():
        np.testing.assert_array_equal(got[hf_name], tensors[gguf_name][0] - 1)
    k = got["model.layers.0.self_attn.k_proj.weight"]
    np.testing.assert_array_equal(k, tensors["blk.0.attn_k.weight"][0])  # not permuted


def test_header_metadata_matches_gguf_reader(tmp_path):
    meta = {"tokenizer.ggml.eot_token_id": 7, "tokenizer.ggml.tokens": ["a", "ü", "<s>"]}
    tensors = {"token_embd.weight": (np.ones((VOCAB, HIDDEN), np.float32), Q.Q8_0)}
    path = _write(tmp_path / "m.gguf", "llama", tensors, meta)
    md = gguf_metadata(path)
    reader = gguf.GGUFReader(path)
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            assert md[key] == field.contents(), key
    header = read_gguf_header(path)
    assert [(t.name, t.shape) for t in header.tensors] == [("token_embd.weight", (VOCAB, HIDDEN))]
    assert header.tensors[0].offset == reader.tensors[0].data_offset


def test_truncated_or_corrupt_files_name_the_file(tmp_path, tiny_llama):
    _, tensors, _ = tiny_llama
    path = _write(tmp_path / "whole.gguf", "llama", tensors)
    data = path.read_bytes()
    header_end = read_gguf_header(path).tensors[0].offset
    for cut in (3, 40, header_end // 2, header_end + 100, len(data) - 1):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=f"cut{cut}.gguf"):
            list(iter_gguf(bad))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(CheckpointError, match="junk.gguf.*not a GGUF"):
        list(iter_gguf(junk))
    with pytest.raises(CheckpointError, match="missing.gguf"):
        list(iter_gguf(tmp_path / "missing.gguf"))


def test_unsupported_architecture_and_unknown_tensors(tmp_path):
    one = {"token_embd.weight": (np.ones((VOCAB, HIDDEN), np.float32), Q.F32)}
    with pytest.raises(CheckpointError, match="'gpt2' is not supported"):
        list(iter_gguf(_write(tmp_path / "gpt2.gguf", "gpt2", one)))
    odd = {**one, "blk.0.mystery.weight": (np.ones(4, np.float32), Q.F32)}
    with pytest.raises(CheckpointError, match="blk.0.mystery.weight"):
        list(iter_gguf(_write(tmp_path / "odd.gguf", "llama", odd)))
    rope = {**one, "rope_freqs.weight": (np.ones(8, np.float32), Q.F32)}
    assert [n for n, _ in iter_gguf(_write(tmp_path / "r.gguf", "llama", rope))] == [
        "model.embed_tokens.weight"
    ]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3moe", "gemma3"])
def test_name_map_is_one_to_one(arch):
    names = hf_name_map(arch, 3)
    assert len(set(names.values())) == len(names)
    assert names["token_embd"] == "model.embed_tokens"
    assert names["blk.2.attn_q"] == "model.layers.2.self_attn.q_proj"


@pytest.mark.parametrize(
    "types, method",
    [((Q.Q8_0,), "int8"), ((Q.Q4_0, Q.Q4_1), "int4")],
    ids=["q8_0", "q4_0+q4_1"],
)
def test_projections_kept_packed_dequantize_to_the_same_weights(tiny_llama, types, method):
    """Q8_0 / Q4_0 / Q4_1 projections load as `layers.quant` leaves (q and k rows
    unpermuted like the float tensors) that dequantize to what `iter_gguf` gives."""
    tmp_path, tensors, _ = tiny_llama
    projections = [
        n
        for n in tensors
        if re.search(r"\.(attn_[qkv]|attn_output|ffn_(gate|up|down))\.weight$", n)
    ]
    tensors = dict(tensors)
    for i, name in enumerate(projections):
        tensors[name] = (tensors[name][0], types[i % len(types)])
    path = _write(tmp_path / "packed.gguf", "llama", tensors)
    assert gguf_packed_method(path) == (method, "")
    floats = dict(iter_gguf(path))
    packed = dict(iter_gguf(path, packed=True))
    scheme = QuantScheme(method, 32)
    for name, value in floats.items():
        if not name.endswith("_proj.weight"):
            np.testing.assert_array_equal(packed[name], value, err_msg=name)
            continue
        leaves = {s: packed[name + s] for s in ("", "_scale", "_offset") if name + s in packed}
        assert leaves[""].dtype == (np.uint8 if method == "int4" else np.int8)
        got = dequantize(leaves, scheme, np)
        np.testing.assert_allclose(got, value, rtol=1e-6, atol=1e-6, err_msg=name)
    assert len(packed) == len(floats) + len(projections) * (2 if method == "int4" else 1)


def test_mixed_projection_types_are_not_kept_packed(tiny_llama):
    tmp_path, tensors, _ = tiny_llama
    method, why = gguf_packed_method(_write(tmp_path / "mixed.gguf", "llama", tensors))
    assert method is None and "BF16" in why and "Q5_0" in why
