"""`jaxengine.hardware`: the chip table and TPU slice names (no JAX)."""

from __future__ import annotations

import pytest

from jaxengine.hardware import GiB, chip_named, chip_of, slice_of


@pytest.mark.parametrize(
    ("name", "topology", "chips", "bounds", "cloud"),
    [
        ("v6e-1", "v6e:1x1", 1, (1, 1, 1), "v6e-1"),
        ("v5e-4", "v5e:2x2", 4, (2, 2, 1), "v5e-4"),
        ("v6e-8", "v6e:2x4", 8, (2, 4, 1), "v6e-8"),
        ("v6e:2x4", "v6e:2x4", 8, (2, 4, 1), "v6e-8"),
        ("v5p-8", "v5p:2x2x1", 4, (2, 2, 1), "v5p-8"),  # v5p counts TensorCores
        ("v4-8", "v4:2x2x1", 4, (2, 2, 1), "v4-8"),
        ("v5p-64", "v5p:2x4x4", 32, None, "v5p-64"),  # several hosts: libtpu's bounds
        ("v5p-128", "v5p:4x4x4", 64, None, "v5p-128"),
        ("v6e-64", "v6e:8x8", 64, None, "v6e-64"),
        ("v5litepod-16", "v5e:4x4", 16, None, "v5e-16"),
    ],
)
def test_slice_names(name, topology, chips, bounds, cloud):
    tpu = slice_of(name)
    assert (tpu.topology, tpu.chips, tpu.chips_per_host_bounds, tpu.name) == (
        topology,
        chips,
        bounds,
        cloud,
    )
    assert tpu.megacore == topology.startswith(("v4", "v5p"))


@pytest.mark.parametrize("bad", ["v6e-3", "v5p-7", "tpu-8", "v7x-8", "v6e:"])
def test_bad_slice_names_say_what_is_accepted(bad):
    with pytest.raises(ValueError, match="v6e|power of two|TensorCores"):
        slice_of(bad)


def test_chips_by_device_kind():
    assert chip_of("TPU v6 lite").name == "v6e"
    assert chip_of("TPU v5 lite").name == "v5e"
    assert chip_of("TPU v5").name == "v5p"
    assert chip_of("TPU v4").name == "v4"
    assert chip_of("NVIDIA H100 80GB HBM3").name == "H100"
    assert chip_of("NVIDIA H200").hbm_bandwidth == 4.8e12
    assert chip_of("cpu") is None
    assert (chip_named("v5e").hbm_bytes, chip_named("v6e").hbm_bytes) == (16 * GiB, 32 * GiB)
    with pytest.raises(ValueError, match="unknown chip"):
        chip_named("v9")
