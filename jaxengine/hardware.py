"""What the accelerators can do, from the vendors' sheets: one table, no JAX.

Each `Chip` names a device generation by the ``device_kind`` strings JAX reports for
it, with its HBM capacity and bandwidth and its dense peak rates. The figures are the
sheets' (per chip; a TPU v4 or v5p chip is one JAX device in megacore mode, as Cloud
TPU VMs run them), not measurements: they are the denominators of every
"fraction of the hardware" this project reports (`bench`), the memory that
``jaxengine tpu-check`` fits an engine into, and, for TPUs, the scoped-VMEM limit the
Pallas TPU kernels size their blocks to (`vmem_limit_bytes`: what the compiler accepts
for one kernel on that generation, below its physical VMEM).

`slice_of` reads a TPU slice's name, in Cloud's form (``v6e-8``, ``v5p-8``: v4 and
v5p count TensorCores, two a chip) or libtpu's (``v6e:2x4``), into the topology that
`jax.experimental.topologies.get_topology_desc` takes.
"""

from __future__ import annotations

import dataclasses
import math
import re

GiB = 1 << 30
MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Chip:
    """One device generation, per chip."""

    name: str  # "v6e", "H200"
    kinds: tuple[str, ...]  # JAX's device_kind strings for it
    hbm_bytes: int
    hbm_bandwidth: float  # bytes/s
    bf16_flops: float  # dense peak, FLOP/s
    fp8_flops: float | None = None  # dense peak with 8-bit floats, where the chip has it
    int8_ops: float | None = None  # dense peak with int8, where the sheet gives it
    vmem_limit_bytes: int | None = None  # TPU: scoped VMEM a Pallas kernel may ask for

    @property
    def is_tpu(self) -> bool:
        return self.vmem_limit_bytes is not None


TPUS = (
    # VMEM: v4 16 MiB a TensorCore (libtpu refuses more), v5e and v6e 128 MiB, v5p 95
    # MiB; the kernels take three quarters of it (the compiler keeps its own scratch)
    Chip("v4", ("TPU v4",), 32 * GiB, 1.2e12, 275e12, int8_ops=275e12, vmem_limit_bytes=16 * MiB),
    Chip("v5e", ("TPU v5 lite", "TPU v5e"), 16 * GiB, 0.819e12, 197e12, int8_ops=394e12,
         vmem_limit_bytes=96 * MiB),
    Chip("v5p", ("TPU v5", "TPU v5p"), 95 * GiB, 2.765e12, 459e12, int8_ops=918e12,
         vmem_limit_bytes=64 * MiB),
    Chip("v6e", ("TPU v6 lite", "TPU v6e"), 32 * GiB, 1.64e12, 918e12, int8_ops=1836e12,
         vmem_limit_bytes=96 * MiB),
)  # fmt: skip

GPUS = (
    Chip("H100", ("NVIDIA H100 80GB HBM3", "NVIDIA H100"), 80 * GiB, 3.35e12, 989e12, 1979e12),
    Chip("H200", ("NVIDIA H200",), 141 * 10**9, 4.8e12, 989e12, 1979e12),
    Chip("B200", ("NVIDIA B200",), 180 * 10**9, 8.0e12, 2250e12, 4500e12),
    Chip("A100", ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"), 80 * GiB, 2.039e12, 312e12),
    Chip("L4", ("NVIDIA L4",), 24 * GiB, 0.3e12, 121e12, 242e12),
)

CHIPS = TPUS + GPUS


def chip_of(device_kind: str) -> Chip | None:
    """The generation JAX's ``device_kind`` names (exact, else the longest kind that
    starts it: "NVIDIA H100 80GB HBM3" before "NVIDIA H100"), or None if unknown."""
    for chip in CHIPS:
        if device_kind in chip.kinds:
            return chip
    known = [(kind, chip) for chip in CHIPS for kind in chip.kinds if device_kind.startswith(kind)]
    return max(known, key=lambda kc: len(kc[0]))[1] if known else None


def chip_named(name: str) -> Chip:
    """The generation called ``name`` ("v5e", "H200"); ValueError naming the known ones."""
    for chip in CHIPS:
        if chip.name.lower() == name.lower():
            return chip
    raise ValueError(f"unknown chip {name!r}: expected one of {', '.join(c.name for c in CHIPS)}")


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    """A TPU slice as libtpu's topology description takes it."""

    chip: Chip
    topology: str  # libtpu's name, e.g. "v6e:2x4"
    chips: int
    chips_per_host_bounds: tuple[int, int, int] | None  # None: libtpu's default (2x2x1)
    megacore: bool  # v4 and v5p: one device per chip (both TensorCores)

    @property
    def name(self) -> str:
        """Cloud's name (``v6e-8``; ``v5p-8`` for 4 chips)."""
        cores = self.chips * (2 if self.megacore else 1)
        return f"{self.chip.name}-{cores}"

    def topology_kwargs(self) -> dict:
        """Keyword arguments of `get_topology_desc` besides the name and platform."""
        kwargs: dict = {}
        if self.chips_per_host_bounds is not None:
            kwargs["chips_per_host_bounds"] = list(self.chips_per_host_bounds)
        if self.megacore:
            kwargs["chip_config_name"] = "megacore"
        return kwargs


_CLOUD = re.compile(r"^(v4|v5e|v5p|v6e)-(\d+)$")
_LIBTPU = re.compile(r"^(v4|v5e|v5p|v6e):(\d+(?:x\d+)*)$")
_THREE_D = ("v4", "v5p")  # 3-D tori, two TensorCores a chip


def slice_of(name: str) -> TpuSlice:
    """``v6e-8`` / ``v6e:2x4`` -> the slice; ValueError naming what is accepted."""
    text = name.strip().lower().replace("v5litepod-", "v5e-")
    cloud, libtpu = _CLOUD.match(text), _LIBTPU.match(text)
    if cloud:
        gen, count = cloud.group(1), int(cloud.group(2))
        chips = count // 2 if gen in _THREE_D else count
        if gen in _THREE_D and count % 2:
            raise ValueError(f"{name}: {gen} slices count TensorCores, two a chip (e.g. {gen}-8)")
        dims = _grid(chips, 3 if gen in _THREE_D else 2)
    elif libtpu:
        gen = libtpu.group(1)
        dims = tuple(int(d) for d in libtpu.group(2).split("x"))
        chips = math.prod(dims)
    else:
        raise ValueError(
            f"--topology {name!r}: expected a Cloud TPU slice (v4-8, v5e-4, v5p-8, v6e-8, ...) "
            "or libtpu's form (v6e:2x4, v5p:2x2x1)"
        )
    chip = chip_named(gen)
    if gen in _THREE_D and len(dims) == 2:
        dims = (*dims, 1)
    topology = f"{gen}:" + "x".join(str(d) for d in dims)
    # one host holds up to 8 chips of a v5e/v6e slice and 4 of a v4/v5p one (2x2x1,
    # libtpu's default); smaller slices are one host of their own shape
    one_host = chips <= (4 if gen in _THREE_D else 8)
    bounds = (*dims, *(1,) * (3 - len(dims))) if one_host else None
    return TpuSlice(chip, topology, chips, bounds, gen in _THREE_D)


def _grid(chips: int, rank: int) -> tuple[int, ...]:
    """The slice shape of ``chips`` chips (a power of two), as Cloud lays them out:
    2-D 1x1, 2x2, 2x4, 4x4, 4x8, 8x8, ...; 3-D 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, ..."""
    if chips < 1 or chips & (chips - 1):
        raise ValueError(f"a TPU slice of {chips} chips: expected a power of two")
    n = chips.bit_length() - 1
    if rank == 2:
        return (1 << (n // 2), 1 << (n - n // 2))
    if n <= 2:
        return ((1, 1, 1), (1, 2, 1), (2, 2, 1))[n]
    return tuple(1 << (n // 3 + (i >= 3 - n % 3)) for i in range(3))
