"""The engine compiled for real TPU generations on this CPU, by libtpu (the tpu extra).

`jaxengine tpu-check` builds the engine as `serve` would on a TPU slice that libtpu
describes here and compiles every start-up program for it (`jaxengine.tpu_check`).
These tests run it on the Llama-3-8B shape with 2 of its 32 layers (every layer
compiles alike) at TP 1 on v6e-1, TP 4 on v5e-4 and TP 8 on v6e-8, one decode and
one prefill bucket each, and check what the command promises: the fit verdict, each
decode step within 1.15x of the least it must move outside the kernels, and a clean
audit; then the audit fails on a program made to copy the cache, the fit fails with
its numbers where the weights do not fit (Llama-3-70B on v5e-4), and the TPU attention
kernel compiles at real head counts for both generations with the block sizes of its
generation. A mixture of experts (Qwen3-30B-A3B's shape, 2 layers, expert parallelism
on v6e-4) passes the audit too: its experts go into the grouped matmul where they lie.
Skipped where libtpu is absent.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

pytest.importorskip("libtpu", reason="the TPU compiler comes with the tpu extra")

from bench.parallel_memory import llama3_8b  # noqa: E402
from bench.tpu_check import QWEN3_30B_A3B  # noqa: E402
from jaxengine.cli.main import main  # noqa: E402
from jaxengine.engine_args import EngineArgs  # noqa: E402
from jaxengine.hardware import chip_named, chip_of, slice_of  # noqa: E402
from jaxengine.runner.attention_backend import select_attention_backend  # noqa: E402
from jaxengine.tpu_check import hlo  # noqa: E402
from jaxengine.tpu_check.audit import audit  # noqa: E402
from jaxengine.tpu_check.check import check_engine, tpu_devices  # noqa: E402
from jaxengine.tpu_check.recorder import CompileRecorder, ProgramFailed  # noqa: E402
from jaxengine.tpu_check.report import MAX_OVER_MINIMUM  # noqa: E402
from pallas_kernels.ragged_paged_attention import tpu as tpu_attention  # noqa: E402

ENGINE = dict(
    max_model_len=8192,
    max_num_seqs=64,
    max_num_batched_tokens=512,
    compile_token_buckets=[64, 512],  # a decode bucket (64 x 1) and a prefill one
)


@pytest.fixture(scope="module")
def llama_2_layers(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("llama3-8b-2-layers")
    config = llama3_8b(layers=2)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize(("topology", "tp"), [("v6e-1", 1), ("v5e-4", 4), ("v6e-8", 8)])
def test_engine_compiles_fits_and_moves_no_more_than_it_must(llama_2_layers, topology, tp):
    args = EngineArgs(model=llama_2_layers, tensor_parallel_size=tp, **ENGINE)
    report = check_engine(args, topology, progress=False)
    assert report.fits, report.lines()
    names = {p.name for p in report.programs}
    assert {"step", "prompt_logprobs", "sampler", "sampler.mask"} <= names
    assert [(s.tokens, s.requests, s.decode) for s in report.steps] == [
        (64, 64, True),
        (512, 64, False),
    ]
    for step in report.steps:  # every weight read once, at least (else the count is off)
        assert step.hbm_bytes >= step.minimum_bytes, report.lines()
        assert step.kernels == 2 * 2  # attention and the cache write, per layer, in Mosaic
    decode = report.steps[0]
    assert decode.bytes_over_minimum <= MAX_OVER_MINIMUM, report.lines()
    assert report.audit_findings == []
    # the weights: 8.0e9 parameters' 2 layers and embeddings, a tensor group's share
    assert report.params_bytes == pytest.approx(2 * 1.486e9 / tp, rel=0.05)
    assert report.kv_tokens > 0 and report.decode_tokens_per_s(1) > 0


def test_moe_experts_go_into_the_grouped_matmul_uncopied(tmp_path):
    """Qwen3-30B-A3B's shape, 2 of its 48 layers, EP 4 on v6e-4 (32 experts a chip):
    the experts are stored ``[E, in, out]``, as `jax.lax.ragged_dot` takes them, so a
    decode step reads each where it lies. Stored as the checkpoint's ``[E, out, in]``,
    XLA copied every expert weight into that layout in every step (the audit's "weight
    copy", 1.78x the minimum)."""
    (tmp_path / "config.json").write_text(json.dumps(dict(QWEN3_30B_A3B, num_hidden_layers=2)))
    args = EngineArgs(
        model=str(tmp_path), tensor_parallel_size=4, enable_expert_parallel=True, **ENGINE
    )
    report = check_engine(args, "v6e-4", progress=False)
    assert report.fits, report.lines()
    assert [s.tokens for s in report.steps if s.decode] == [64]
    assert report.audit_findings == [], report.lines()
    assert report.worst_decode_ratio <= MAX_OVER_MINIMUM, report.lines()
    # the experts stream through ragged_dot's grouped-matmul kernel: counted, not lost
    assert min(s.bytes_over_minimum for s in report.steps if s.decode) >= 0.99, report.lines()


def test_audit_finds_a_copied_cache():
    """A step that keeps the old cache beside the new one must copy it: the audit says
    so; the engine's own steps pass it (above)."""
    tpu = slice_of("v5e-1")
    mesh = Mesh(tpu_devices(tpu)[:1], ("x",))
    placed = NamedSharding(mesh, PartitionSpec())
    cache = jax.ShapeDtypeStruct((1024, 16, 16, 128), jnp.bfloat16, sharding=placed)
    row = jax.ShapeDtypeStruct((16, 16, 128), jnp.bfloat16, sharding=placed)

    def keeps_both(cache, row):
        return cache.at[3].set(row), cache

    hlo = jax.jit(keeps_both).lower(cache, row).compile().as_text()
    findings = audit(hlo, {("bf16", (1024, 16, 16, 128))}, set())
    assert findings and {f.rule for f in findings} == {"kv-cache copy"}, hlo[:2000]
    donated = jax.jit(lambda c, r: c.at[3].set(r), donate_argnums=0).lower(cache, row).compile()
    assert audit(donated.as_text(), {("bf16", (1024, 16, 16, 128))}, set()) == []


def test_hbm_traffic_counts_a_prefetched_weight_once():
    """XLA prefetches a decode matmul's weight into VMEM (a cross-program prefetch):
    its cost analysis counts that weight five times; the HBM count once."""
    mesh = Mesh(tpu_devices(slice_of("v5e-1"))[:1], ("x",))
    placed = NamedSharding(mesh, PartitionSpec())
    w = jax.ShapeDtypeStruct((4096, 14336), jnp.bfloat16, sharding=placed)
    x = jax.ShapeDtypeStruct((64, 4096), jnp.bfloat16, sharding=placed)
    compiled = jax.jit(lambda w, x: x @ w).lower(w, x).compile()
    module = hlo.parse(compiled.as_text())
    assert any(i.opcode == "copy-start" for i in module.instructions())  # the prefetch
    weight, rest = 4096 * 14336 * 2, (64 * 4096 + 64 * 14336) * 2
    assert hlo.hbm_bytes(module) == weight + rest
    assert compiled.cost_analysis()["bytes accessed"] > 4 * weight
    assert audit(module, set(), {("bf16", (4096, 14336))}) == []  # a prefetch, no copy


def test_hbm_traffic_counts_a_donated_scatter_in_place():
    """Rows scattered into a donated cache (the MLA cache write, XLA's scatter) move
    their indices and rows, not the cache."""
    mesh = Mesh(tpu_devices(slice_of("v6e-1"))[:1], ("x",))
    placed = NamedSharding(mesh, PartitionSpec())
    cache = jax.ShapeDtypeStruct((4096, 640), jnp.bfloat16, sharding=placed)
    rows = jax.ShapeDtypeStruct((64, 640), jnp.bfloat16, sharding=placed)
    slots = jax.ShapeDtypeStruct((64,), jnp.int32, sharding=placed)

    def write(cache, rows, slots):
        return cache.at[slots].set(rows, mode="drop")

    compiled = jax.jit(write, donate_argnums=0).lower(cache, rows, slots).compile()
    moved = hlo.hbm_bytes(hlo.parse(compiled.as_text()))
    assert 2 * 64 * 640 * 2 <= moved <= 4 * 64 * 640 * 2 + 4096, compiled.as_text()


def test_70b_does_not_fit_v5e_4_and_says_by_how_much(tmp_path, capsys):
    config = llama3_8b()
    config.update(dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, architectures=["LlamaForCausalLM"]))  # fmt: skip
    config.save_pretrained(tmp_path)
    out = tmp_path / "report.json"
    argv = ["tpu-check", str(tmp_path), "--topology", "v5e-4", "-tp", "4", "--output", str(out)]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tpu-check: FAILED: v5e-4: ")
    assert "weights take 32.8" in err[0] and "GiB" in err[0], err
    assert not out.exists()


def _attention_args(tpu_name: str, tokens: int, requests: int, kv_heads: int = 8):
    """Abstract inputs of one layer's attention at Llama-3-8B's heads, on one chip."""
    mesh = Mesh(tpu_devices(slice_of(tpu_name))[:1], ("x",))
    placed = NamedSharding(mesh, PartitionSpec())

    def shape(dims, dtype=jnp.int32):
        return jax.ShapeDtypeStruct(dims, dtype, sharding=placed)

    return (
        shape((tokens, 4 * kv_heads, 128), jnp.bfloat16),
        shape((4096, 16, 2 * kv_heads, 128), jnp.bfloat16),
        shape((requests,)),
        shape((requests, 512)),
        shape((requests + 1,)),
        shape(()),
    )


@pytest.mark.parametrize("tpu_name", ["v5e-1", "v6e-1"])
def test_attention_kernel_compiles_at_real_heads_sized_for_its_generation(tpu_name):
    """The backend the engine picks for a chip's device kind sizes the kernel's blocks
    to that generation's VMEM, and libtpu compiles it (prefill: 512 tokens over 64
    requests; 32 query heads, 8 KV heads, pages of 16, 8k context)."""
    kind = tpu_devices(slice_of(tpu_name))[0].device_kind
    backend = select_attention_backend("auto", "tpu", device_kind=kind)
    assert backend.name == "pallas-tpu"
    assert backend.attention_fn.keywords["vmem_limit_bytes"] == chip_of(kind).vmem_limit_bytes
    attention = functools.partial(backend.attention_fn, sm_scale=128**-0.5)
    recorder = CompileRecorder()
    recorder.compile("attention", None, lambda: jax.jit(attention).lower(
        *_attention_args(tpu_name, 512, 64)))  # fmt: skip
    assert recorder.records[0].bytes_accessed > 0


def test_a_kernel_past_v4s_vmem_fails_in_one_line():
    """Blocks forced past v4's 16 MiB of VMEM: one line naming the program and why."""
    attention = functools.partial(
        tpu_attention.ragged_paged_attention, sm_scale=0.1, heads_per_block=8,
        pages_per_block=64, vmem_limit_bytes=chip_named("v4").vmem_limit_bytes,
    )  # fmt: skip
    recorder = CompileRecorder()
    with pytest.raises(ProgramFailed) as failed:
        recorder.compile("attention", None, lambda: jax.jit(attention).lower(
            *_attention_args("v4-8", 512, 64)))  # fmt: skip
    message = str(failed.value)
    assert message.startswith("attention: ") and "\n" not in message
    assert "RESOURCE_EXHAUSTED" in message and "vmem" in message.lower(), message


@pytest.mark.parametrize("kv_heads", [5, 1])
def test_attention_kernel_compiles_with_odd_kv_heads_per_chip(kv_heads):
    """Phi-4's 10 KV heads at TP 2 leave 5 a chip: the kernel's block of every head is
    the cache's whole head axis (a slice of 10 rows at a traced offset is not provably
    tile-aligned, and Mosaic refused it); decode and prefill shapes."""
    backend = select_attention_backend("auto", "tpu", device_kind="TPU v6 lite")
    attention = functools.partial(backend.attention_fn, sm_scale=128**-0.5)
    recorder = CompileRecorder()
    for tokens, requests in ((64, 64), (512, 8)):
        args = _attention_args("v6e-1", tokens, requests, kv_heads=kv_heads)
        recorder.compile("attention", None, lambda a=args: jax.jit(attention).lower(*a))
    assert len(recorder.records) == 2


def test_state_pools_updated_in_place_and_counted():
    """Qwen3.5's linear-attention pools at TP 4 for 256 requests (384 rows, prefix
    caching's saved states included): the convolution windows ``f32[384, 6144]``
    (channel-major rows; laid out ``[384, 3, 2048]`` XLA moved the 3 out of the
    sublanes and copied the whole pool around every gather and scatter) read by XLA
    and written by the DMA kernel (XLA's scatter staged the pool in VMEM and copied
    it back), the delta-rule states by the rule's kernel in place. No pool is copied,
    and the HBM count takes what the kernels move in the pools from ``state_pools``
    (one read and one write of each request's row)."""
    from jaxengine.models.layers.gated_delta import conv_rows, conv_window
    from pallas_kernels.gated_delta import reference, rows, tpu

    mesh = Mesh(tpu_devices(slice_of("v6e-1"))[:1], ("x",))
    placed = NamedSharding(mesh, PartitionSpec())

    def shape(dims, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(dims, dtype, sharding=placed)

    def step(conv, ssm, at, fresh, x, q, v, g):
        live = reference.live_requests(at, 256)
        window = conv_window(reference.read_rows(conv, at, live & ~fresh), 4)
        conv = rows.write_rows(conv, at, live, conv_rows(window * 0.5 + x[:, None]))
        qsl = jnp.arange(257, dtype=jnp.int32)
        out, ssm = tpu.gated_delta_rule(q, q, v, g, g, qsl, 256, ssm, at, fresh)
        return conv, ssm, out

    pools = (shape((384, 6144)), shape((384, 8, 128, 128)))
    index = (shape((256,), jnp.int32), shape((256,), bool), shape((256, 2048)))
    tokens = (shape((256, 4, 128), jnp.bfloat16), shape((256, 8, 128), jnp.bfloat16))
    compiled = (
        jax.jit(step, donate_argnums=(0, 1))
        .lower(*pools, *index, *tokens, shape((256, 8)))
        .compile()
    )
    module = hlo.parse(compiled.as_text())
    shapes = {("f32", (384, 6144)), ("f32", (384, 8, 128, 128))}
    assert audit(module, shapes, set()) == [], compiled.as_text()
    moved = {("f32", (384, 6144)): 2 * 256 * 6144 * 4, ("f32", (384, 8, 128, 128)): 2 * 256 << 19}
    extra = hlo.hbm_bytes(module, state_pools=moved) - hlo.hbm_bytes(module)
    assert extra == sum(moved.values())


def test_minimum_leaves_out_the_tables_a_step_gathers_from():
    """`weights_read`: an untied input embedding and per-layer input tables (Gemma 4)
    are gathered a row a token, so the minimum leaves them out; a tied embedding is
    the LM head, read whole."""
    from jaxengine.tpu_check.report import weights_read

    table = jax.ShapeDtypeStruct((1000, 16), jnp.bfloat16)  # 32,000 bytes
    per_layer = jax.ShapeDtypeStruct((1000, 64), jnp.bfloat16)  # 128,000 bytes
    layer = jax.ShapeDtypeStruct((16, 16), jnp.bfloat16)  # 512 bytes
    model = {"embed_tokens": {"embedding": table}, "layers_0": {"w": layer}}
    assert weights_read({"model": model, "lm_head": {"weight": table}}) == 512 + 32_000
    assert weights_read({"model": model}) == 32_000 + 512
    gemma4 = {"model": {**model, "embed_tokens_per_layer": {"embedding": per_layer}}}
    assert weights_read(gemma4) == 32_000 + 512
