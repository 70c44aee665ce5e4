"""The kernels section's block sweep: the Pallas GPU attention kernel's tile options timed.

On the ``prefill`` (4 x 2,048) and ``mixed`` (60 decodes + 4 chunks of 128) workloads
(`bench.device.kernels.workloads`), `pallas_kernels.ragged_paged_attention.gpu` runs
under each `Config` of `grid`: ``block_m`` {128, 64} x ``block_n`` {128, 64} x
``num_warps`` {8, 4} x ``num_stages`` {3, 2} x ``contiguous_pages`` {on, off} (the
kernel's KV paths: with pages of 16, "pages" when on, "gather" when off), the
kernel's own default first; then, for prefill, ``block_m`` 256 and pages of 128 (the
"slice" path: one page id per KV block), which the engine's cache of 16-token pages
does not use yet. Each config's first call (which compiles) is checked against the
reference's output (``max_err``, once per page size) and a config over ``MAX_ERR`` is
not timed; the others are timed like the section's peers (`bench.kernels.time_attention`).

Budget: the sweep items share what is left of the kernels section's budget, which
`bench.device.kernels.run` extends by ``Profile.sweep_s`` (prefill gets
``PREFILL_SHARE`` of it). A config starts only while the time left exceeds the
longest config so far; the rows that ran are recorded, with ``stopped`` saying why the
rest did not. Figures per row: median us, TFLOP/s (`cost.batch_cost`'s flops), its
fraction of the sheet's dense bf16 peak (``of_sheet``: `jaxengine.hardware.chip_of`,
None off the table, e.g. on a CPU) and of the run's matmul probe (``of_matmul``).

On a CPU (the dry run) the kernel runs in interpret mode at the dry run's tiny sizes,
three configs, one per KV path: what it checks is that the sweep runs, not speed.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import numpy as np

from bench.device.profile import Profile
from bench.device.record import OutOfTime

MAX_ERR = 0.05  # bf16 outputs of unit-scale data: the section's own check is ~0.016
PREFILL_SHARE = 0.65


@dataclasses.dataclass(frozen=True)
class Config:
    """One point of the sweep: the kernel's keyword arguments (and the cache's page)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    contiguous_pages: bool
    page_size: int | None = None  # None: the workload's own (16)

    def label(self) -> str:
        text = f"m{self.block_m} n{self.block_n} w{self.num_warps} s{self.num_stages}"
        text += " pages" if self.contiguous_pages else " gather"
        return text + (f" p{self.page_size}" if self.page_size else "")

    def kwargs(self) -> dict[str, Any]:
        fields = ("block_m", "block_n", "num_warps", "num_stages", "contiguous_pages")
        return {name: getattr(self, name) for name in fields}


DEFAULT = Config(64, 64, 8, 2, False)  # `gpu.choose_blocks` at prefill, head dim 128
EXTRA_PREFILL = (
    Config(256, 64, 8, 2, True),
    Config(256, 64, 8, 3, True),
    Config(128, 128, 8, 3, True, page_size=128),
    Config(128, 64, 8, 3, True, page_size=128),
    Config(64, 64, 8, 2, True, page_size=128),
)
DRY_RUN_GRID = (
    Config(16, 16, 4, 2, False),  # "gather"
    Config(32, 32, 4, 2, True),  # "pages": 2 pages of 16 per block
    Config(16, 16, 4, 2, True),  # "slice": one page per block
)


def grid(profile: Profile, workload: str) -> list[Config]:
    """The configs in the order they run: the default, then likely winners first."""
    if profile.small_model:
        return list(DRY_RUN_GRID)
    configs = [DEFAULT]
    for block_m in (128, 64):
        for num_warps in (8, 4):
            for num_stages in (3, 2):
                for block_n in (128, 64):
                    for pages in (True, False):
                        c = Config(block_m, block_n, num_warps, num_stages, pages)
                        configs += [c] if c != DEFAULT else []
    return configs + list(EXTRA_PREFILL if workload == "prefill" else ())


def peak_tflop_s(denominators: dict[str, float]) -> float | None:
    """The sheet's dense bf16 TFLOP/s: the environment section's, else looked up here."""
    if denominators.get("sheet_bf16_tflop_s"):
        return denominators["sheet_bf16_tflop_s"]
    from bench.device.environment import sheet

    figures = sheet()
    return figures["sheet_bf16_tflop_s"] if figures else None


class Inputs:
    """A workload's paged arrays and the reference's output, per page size (lazily)."""

    def __init__(self, workload: Any) -> None:
        self.workload = workload
        self.cache: dict[int, tuple[Any, np.ndarray]] = {}

    def get(self, page_size: int | None) -> tuple[Any, np.ndarray]:
        import jax
        import jax.numpy as jnp

        from bench.kernels import make_arrays
        from pallas_kernels.ragged_paged_attention import reference

        page = page_size or self.workload.page_size
        if page not in self.cache:
            w = dataclasses.replace(self.workload, page_size=page)
            arrays = make_arrays(w, jnp.bfloat16, dense=False)
            ref = jax.jit(functools.partial(reference.ragged_paged_attention,
                                            sm_scale=arrays.sm_scale))  # fmt: skip
            self.cache[page] = (arrays, np.asarray(ref(*arrays.paged), np.float32))
        return self.cache[page]


def run_config(c: Config, inputs: Inputs, profile: Profile, rates: dict) -> dict[str, Any]:
    """One config: checked against the reference once, then timed; a row of the table."""
    import jax
    import jax.numpy as jnp

    from bench.kernels import time_attention, workload_cost
    from pallas_kernels.ragged_paged_attention import gpu

    arrays, want = inputs.get(c.page_size)
    page = c.page_size or inputs.workload.page_size
    row: dict[str, Any] = {"config": c.label(), **dataclasses.asdict(c), "page_size": page}
    row["path"] = gpu.choose_kv_path(c.contiguous_pages, page, c.block_n, want.shape[-1])
    interpret = jax.default_backend() != "gpu"
    fn = jax.jit(functools.partial(gpu.ragged_paged_attention, sm_scale=arrays.sm_scale,
                                   interpret=interpret, **c.kwargs()))  # fmt: skip
    try:
        got = np.asarray(fn(*arrays.paged), np.float32)  # compiles
        row["max_err"] = float(np.abs(got - want).max())
        row["ok"] = bool(row["max_err"] <= MAX_ERR)
        if row["ok"]:
            cost = workload_cost(inputs.workload, jnp.bfloat16)
            timing = time_attention(fn, arrays.paged, cost, profile.iters)
            row["us"] = timing.seconds * 1e6
            row["tflop_s"] = timing.flops_per_s / 1e12
            for key, denominator in rates.items():
                row[key] = row["tflop_s"] / denominator if denominator else None
    except Exception as exc:  # noqa: BLE001 - a config that does not compile (registers)
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    return row


def sweep(workload: Any, profile: Profile, denominators: dict, seconds: float) -> dict:
    """`grid`'s configs on ``workload`` within ``seconds``: the rows that ran, the best."""
    import jax

    if jax.default_backend() not in ("gpu", "cpu"):
        return {"skipped": "the Pallas GPU kernel's sweep: no GPU (nor interpret mode)"}
    deadline = time.perf_counter() + seconds
    configs = grid(profile, workload.name)
    peak = peak_tflop_s(denominators)
    rates = {"of_sheet": peak, "of_matmul": denominators.get("matmul_tflop_s")}
    result: dict[str, Any] = {"planned": len(configs), "peak_tflop_s": peak, "rows": []}
    inputs, longest = Inputs(workload), 0.0
    try:
        for c in configs:
            if time.perf_counter() + longest > deadline:
                result["stopped"] = "budget spent"
                break
            began = time.perf_counter()
            row = run_config(c, inputs, profile, rates)
            row["seconds"] = round(time.perf_counter() - began, 2)
            longest = max(longest, row["seconds"])
            result["rows"].append(row)
    except OutOfTime:  # the section's alarm: keep the rows that ran
        result["stopped"] = "the section's budget ran out mid-config"
    timed = [r for r in result["rows"] if r.get("tflop_s")]
    result["ran"] = len(result["rows"])
    result["best"] = max(timed, key=lambda r: r["tflop_s"])["config"] if timed else None
    return result


def run(section: Any, profile: Profile, denominators: dict, workloads: list) -> None:
    """The sweep items, ``sweep_prefill`` then ``sweep_mixed``, in the section's time."""
    by_name = {w.name: w for w in workloads}
    for name, share in (("prefill", PREFILL_SHARE), ("mixed", 1.0)):
        seconds = max(section.remaining() * share - 1.0, 0.0)  # a second to record
        w = by_name[name]
        section.item(f"sweep_{name}", lambda w=w, s=seconds: sweep(w, profile, denominators, s))
