"""Choosing the attention kernels: by platform, overridden by ``--attention-backend``.

=============  ====================  =====================  ==========================
requested      tpu                   gpu                    cpu
=============  ====================  =====================  ==========================
auto           Pallas TPU (Mosaic)   Pallas GPU (Triton)    xla-cpu (request-major)
pallas         Pallas TPU (Mosaic)   Pallas GPU (Triton)    Pallas GPU, interpret mode
reference      reference             reference              reference
=============  ====================  =====================  ==========================

The attention function and the KV-cache write are chosen together, so the cache
layout they agree on never mixes. On CPU, "auto" runs
`pallas_kernels.ragged_paged_attention.cpu`: plain JAX like the reference, laid out
request-major so XLA's CPU backend gathers each request's pages once (several times
faster than the reference on decode and prefill batches, bench/README.md), with the
reference's KV-cache write. On CPU, "pallas" runs the GPU kernels in interpret
mode: slow, there to prove the kernels inside the real step function. (They interpret
several times faster than the TPU kernels, whose DMAs and semaphores the TPU
interpreter simulates; tests run the TPU kernels inside the model on tiny configs.)

A model with multi-head latent attention (DeepSeek-V3) has a cache of one latent row a
token that only `pallas_kernels.mla` reads and writes; its table is the same with the
MLA functions (`mla_kernels`): "mla-pallas-tpu" (the Mosaic kernel; its write is the
reference's XLA scatter, as Mosaic's DMAs cannot write one row inside a bfloat16 HBM
tile), "mla-pallas-gpu" (Triton), "mla-pallas-gpu-interpret" (``pallas`` on CPU) and
"mla-reference" (``reference`` anywhere, ``auto`` on CPU).

A hybrid model (Qwen3-Next, Qwen3.5: ``gated_delta``) also gets the gated delta rule of
its linear-attention layers (`pallas_kernels.gated_delta`, ``gated_delta_fn``) by the
same table: the Mosaic kernel on TPU, Triton's on GPU, Triton's interpreted for
``pallas`` on CPU, and the reference in 16-token chunks
(`models.layers.gated_delta.reference_rule`) for ``reference`` and ``auto`` on CPU.
The causal convolution before it is the reference's everywhere (no kernel); its
windows go back to their pool by ``state_write_fn``: in place by DMA on TPU
(`pallas_kernels.gated_delta.rows`), XLA's scatter
(`pallas_kernels.gated_delta.reference.write_rows`) elsewhere and for ``reference``.

The TPU attention kernel sizes its blocks to the scoped VMEM of the generation it is
compiled for: ``device_kind``, that of the engine's devices (the compile target,
which ``jaxengine tpu-check`` sets to a TPU slice on a machine without one), looked up
in `jaxengine.hardware` (v4 16 MiB, v5e/v6e 96 MiB, v5p 64 MiB); the MLA kernel alike.
The KV-cache write copies rows HBM to HBM by DMA and holds nothing in VMEM.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging
from collections.abc import Callable

import jax

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    name: str  # "reference", "xla-cpu", "pallas-tpu", "pallas-gpu", "pallas-gpu-interpret"
    attention_fn: Callable
    update_fn: Callable
    gated_delta_fn: Callable | None = None
    """The gated delta rule of a hybrid model's linear-attention layers (the signature
    of `pallas_kernels.gated_delta.reference.gated_delta_rule`: the state pool and each
    request's row in, the updated pool out); None elsewhere."""
    state_write_fn: Callable | None = None
    """A hybrid model's write of the convolution windows' rows into their pool
    (``(pool, rows, keep, states) -> pool``, `reference.write_rows`); None elsewhere."""

    def module_kwargs(self) -> dict:
        """What the model modules take as ``attention_kwargs`` (``gated_delta_fn`` only
        for a hybrid model, whose decoder layer hands it to its Gated DeltaNet)."""
        kwargs = {"attention_fn": self.attention_fn, "update_fn": self.update_fn}
        if self.gated_delta_fn is not None:
            kwargs["gated_delta_fn"] = self.gated_delta_fn
        if self.state_write_fn is not None:
            kwargs["state_write_fn"] = self.state_write_fn
        return kwargs


def select_attention_backend(
    requested: str,
    platform: str | None = None,
    both_ways: bool = False,
    device_kind: str | None = None,
    *,
    mla: bool = False,
    gated_delta: bool = False,
) -> AttentionBackend:
    """The backend for ``--attention-backend requested`` on ``platform`` (default:
    JAX's); ``device_kind``: the generation the TPU kernels are sized for (None: the
    kernels' default, 16 MiB of scoped VMEM). ``both_ways`` (a model whose image
    tokens attend to each other both ways, Gemma 3 and 4 with images): the attention
    must take each token's last key (``attend_until``), as every backend's here does
    (the Pallas kernels bound each block's KV loop by its rows' last); one that does
    not is replaced by the reference, with a warning (`takes_attend_until`). ``mla``
    (a model with multi-head latent attention, DeepSeek-V3): its cache holds one
    latent row a token, which only the MLA functions read and write
    (`pallas_kernels.mla`, `_mla_backend`). ``gated_delta`` (a hybrid model, Qwen3-Next
    and Qwen3.5): the backend also carries ``gated_delta_fn`` (`gated_delta_kernel`)."""
    platform = platform or jax.default_backend()
    if mla:
        return _mla_backend(requested, platform, device_kind)
    backend = _select(requested, platform)
    if backend.name == "pallas-tpu" and device_kind is not None:
        backend = _sized_for(backend, device_kind)
    if both_ways and not takes_attend_until(backend.attention_fn):
        logger.warning(
            "attention backend %s has no bidirectional image attention: the model's "
            "image tokens attend both ways, so the reference attention runs",
            backend.name,
        )
        backend = AttentionBackend("reference", *kernels("reference"))
    if gated_delta:
        rule = gated_delta_kernel(requested, platform, device_kind)
        write = state_write_kernel(requested, platform)
        backend = dataclasses.replace(backend, gated_delta_fn=rule, state_write_fn=write)
    return backend


def takes_attend_until(attention_fn: Callable) -> bool:
    """Whether ``attention_fn`` (a kernel, a partial or a jitted one) takes
    ``attend_until``, the per-token key limit of image tokens that attend both ways:
    by name, or a wrapper's ``**kwargs`` (which forwards it)."""
    try:
        params = inspect.signature(attention_fn).parameters
    except (TypeError, ValueError):  # no signature to read: assume it does not
        return False
    forwards = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return "attend_until" in params or forwards


def _mla_backend(requested: str, platform: str, device_kind: str | None) -> AttentionBackend:
    """The MLA functions (`pallas_kernels.mla`) by the table of `_select`: the Mosaic
    kernel on TPU (sized for ``device_kind``), Triton's on GPU or, for ``pallas`` on
    CPU, interpreted; the reference for ``reference``, and for ``auto`` on CPU."""
    _select(requested, "cpu")  # the same validation of the flag
    if requested == "reference" or (requested == "auto" and platform not in ("tpu", "gpu")):
        return AttentionBackend("mla-reference", *mla_kernels("reference"))
    if platform in ("tpu", "gpu"):
        backend = AttentionBackend(f"mla-pallas-{platform}", *mla_kernels(platform))
        if platform == "tpu" and device_kind is not None:
            backend = _sized_for(backend, device_kind)
        return backend
    attention, update = mla_kernels("gpu")
    return AttentionBackend(
        "mla-pallas-gpu-interpret",
        functools.partial(attention, interpret=True),
        functools.partial(update, interpret=True),
    )


def _select(requested: str, platform: str) -> AttentionBackend:
    if requested not in ("auto", "pallas", "reference"):
        raise ValueError(
            f"--attention-backend {requested!r}: expected one of auto, pallas, reference"
        )
    if requested == "reference":
        return AttentionBackend("reference", *kernels("reference"))
    if requested == "auto" and platform not in ("tpu", "gpu"):
        attention = importlib.import_module("pallas_kernels.ragged_paged_attention.cpu")
        _, update = kernels("reference")
        return AttentionBackend("xla-cpu", attention.ragged_paged_attention, update)
    if platform in ("tpu", "gpu"):
        return AttentionBackend(f"pallas-{platform}", *kernels(platform))
    attention, update = kernels("gpu")
    return AttentionBackend(
        "pallas-gpu-interpret",
        functools.partial(attention, interpret=True),
        functools.partial(update, interpret=True),
    )


def _sized_for(backend: AttentionBackend, device_kind: str) -> AttentionBackend:
    """The TPU kernels with the scoped-VMEM limit of ``device_kind``'s generation."""
    from jaxengine.hardware import chip_of

    chip = chip_of(device_kind)
    if chip is None or not chip.is_tpu:
        logger.warning(
            "unknown TPU generation %r: the kernels keep their default sizes", device_kind
        )
        return backend
    attention = functools.partial(backend.attention_fn, vmem_limit_bytes=chip.vmem_limit_bytes)
    return dataclasses.replace(backend, attention_fn=attention)


def gated_delta_kernel(requested: str, platform: str, device_kind: str | None = None) -> Callable:
    """The gated delta rule by the table of `_select`: the Mosaic kernel on TPU (its
    VMEM limit that of ``device_kind``'s generation), Triton's on GPU or, for
    ``pallas`` on CPU, interpreted; the reference in 16-token chunks for
    ``reference``, and for ``auto`` on CPU (the CPU default)."""
    _select(requested, "cpu")  # the same validation of the flag
    if requested == "reference" or (requested == "auto" and platform not in ("tpu", "gpu")):
        from jaxengine.models.layers.gated_delta import reference_rule

        return reference_rule
    if platform not in ("tpu", "gpu"):
        gpu = importlib.import_module("pallas_kernels.gated_delta.gpu")
        return functools.partial(gpu.gated_delta_rule, interpret=True)
    rule = importlib.import_module(f"pallas_kernels.gated_delta.{platform}").gated_delta_rule
    if platform == "tpu" and device_kind is not None:
        from jaxengine.hardware import chip_of

        chip = chip_of(device_kind)
        if chip is not None and chip.is_tpu:
            rule = functools.partial(rule, vmem_limit_bytes=chip.vmem_limit_bytes)
    return rule


def state_write_kernel(requested: str, platform: str) -> Callable:
    """The write of a state pool's rows (`gated_delta_kernel`'s companion): the Mosaic
    DMA kernel on TPU (but for ``reference``), XLA's scatter everywhere else."""
    from pallas_kernels.gated_delta import reference, rows

    if platform == "tpu" and requested != "reference":
        return rows.write_rows
    return reference.write_rows


def kernels(name: str) -> tuple[Callable, Callable]:
    """The attention function and KV-cache write of ``pallas_kernels.*.{name}``."""
    attention = importlib.import_module(f"pallas_kernels.ragged_paged_attention.{name}")
    update = importlib.import_module(f"pallas_kernels.kv_cache_update.{name}")
    return attention.ragged_paged_attention, update.update_kv_cache


def mla_kernels(name: str) -> tuple[Callable, Callable]:
    """The MLA attention function and cache write of ``pallas_kernels.mla.{name}``."""
    mla = importlib.import_module(f"pallas_kernels.mla.{name}")
    return mla.ragged_paged_mla, mla.update_mla_cache
