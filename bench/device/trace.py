"""A `jax.profiler` trace read into a table, with what jaxlib ships (no xprof, no
TensorBoard): `jax.profiler.ProfileData.from_file` on the ``*.xplane.pb`` that
``jax.profiler.trace(folder)`` writes.

Which events are "device work" depends on the platform (`device_events`):

- a GPU (or TPU) trace has a ``/device:GPU:N`` plane; its ``Stream #...`` lines hold
  the kernels and copies as the device ran them (a TPU's ``XLA Ops`` line, where
  there are no streams);
- a CPU trace has no device plane: the XLA CPU executor's ops (host events with an
  ``hlo_op`` stat, on its worker threads' lines of ``/host:CPU``) stand in for it.

The result says which plane and lines were read. Steps are host annotations
(`jax.profiler.TraceAnnotation`) whose names start with a given prefix: the device
events that begin between one annotation's start and the next one's belong to that
step; the host gap between two steps is the time from the end of one step's last
device event to the start of the next step's first (the device idle while the host
schedules, pads and dispatches). Without annotations, the whole window is one step.

Host code: the profile is read through a lazy import; `summarize` takes any objects
with the `ProfileData` shape (``planes`` / ``lines`` / ``events`` with ``name``,
``start_ns``, ``duration_ns`` and ``stats``), so tests can feed it a recorded trace.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DERIVED_LINES = ("XLA Modules", "Steps", "Framework Name Scope", "Source code", "Launch Stats",
                 "XLA TraceMe", "TensorFlow Name Scope", "TensorFlow Ops")  # fmt: skip
BYTES_IN_DETAILS = re.compile(r"(?:size|num_bytes):(\d+)")


@dataclass(frozen=True)
class Event:
    """One piece of device work (or a CPU executor op), in nanoseconds."""

    name: str
    start: float
    end: float
    bytes: int | None = None


@dataclass
class DeviceTrace:
    """The device events of a trace and where they were read from."""

    plane: str
    lines: list[str]
    events: list[Event]
    plane_stats: dict[str, Any] = field(default_factory=dict)


def load(folder: str | Path) -> Any:
    """The `ProfileData` of the newest ``*.xplane.pb`` under ``folder``."""
    from jax.profiler import ProfileData

    files = sorted(Path(folder).rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no *.xplane.pb under {folder}")
    return ProfileData.from_file(str(files[-1]))


def _bytes(stats: dict[str, Any]) -> int | None:
    """Bytes an event moved, where its stats say (a copy's details, a TPU op's
    ``bytes_accessed``)."""
    for key in ("bytes_accessed", "raw_bytes_accessed"):
        if isinstance(stats.get(key), (int, float)):
            return int(stats[key])
    details = stats.get("memcpy_details") or stats.get("memset_details")
    if isinstance(details, str) and (m := BYTES_IN_DETAILS.search(details)):
        return int(m.group(1))
    return None


def _events(lines: Iterable[Any], cpu_ops: bool) -> list[Event]:
    """The lines' events of nonzero length; with ``cpu_ops``, those with an ``hlo_op``
    stat and outermost on their line (a ``while`` op holds its body's ops: counted
    once)."""
    out = []
    for line in lines:
        reach = float("-inf")
        for e in sorted(line.events, key=lambda ev: (ev.start_ns, -ev.duration_ns)):
            stats = dict(e.stats)
            start, end = float(e.start_ns), float(e.start_ns) + float(e.duration_ns)
            if e.duration_ns <= 0 or (cpu_ops and ("hlo_op" not in stats or end <= reach)):
                continue
            reach = max(reach, end)
            out.append(Event(e.name, start, end, _bytes(stats)))
    return sorted(out, key=lambda ev: ev.start)


def _device_lines(plane: Any) -> list[Any]:
    """A device plane's lines of device work: its streams, else its ``XLA Ops``
    line, else every line that is not derived from the others."""
    lines = list(plane.lines)
    for keep in (lambda n: n.startswith("Stream"), lambda n: n == "XLA Ops"):
        if chosen := [ln for ln in lines if keep(ln.name)]:
            return chosen
    return [ln for ln in lines if ln.name not in DERIVED_LINES]


def device_events(profile: Any) -> DeviceTrace:
    """The first device plane's work, or the CPU executor's ops on ``/host:CPU``."""
    planes = list(profile.planes)
    for plane in planes:
        if plane.name.startswith("/device:") and (lines := _device_lines(plane)):
            if events := _events(lines, cpu_ops=False):
                stats = {k: v for k, v in plane.stats if isinstance(v, (int, float, str))}
                return DeviceTrace(plane.name, [ln.name for ln in lines], events, stats)
    for plane in planes:
        if plane.name == "/host:CPU":
            lines = [ln for ln in plane.lines if any("hlo_op" in dict(e.stats) for e in ln.events)]
            return DeviceTrace(
                plane.name + " (XLA CPU executor ops: no device plane)",
                [ln.name for ln in lines],
                _events(lines, cpu_ops=True),
            )
    raise ValueError(f"no device plane and no /host:CPU in {[p.name for p in planes]}")


def annotations(profile: Any, prefix: str) -> list[tuple[str, float, float]]:
    """``(name, start, end)`` of the host events whose names start with ``prefix``."""
    found = []
    for plane in profile.planes:
        if not plane.name.startswith("/host:"):
            continue
        for line in plane.lines:
            for e in line.events:
                if e.name.startswith(prefix):
                    start = float(e.start_ns)
                    found.append((e.name, start, start + float(e.duration_ns)))
    return sorted(found, key=lambda a: a[1])


def busy_ns(events: Sequence[Event]) -> float:
    """Time covered by at least one event (the union of their intervals)."""
    total, reach = 0.0, float("-inf")
    for ev in sorted(events, key=lambda e: e.start):
        if ev.end > reach:
            total += ev.end - max(ev.start, reach)
            reach = ev.end
    return total


def top_kernels(events: Sequence[Event], top: int) -> list[dict[str, Any]]:
    """The ``top`` event names by total time: count, total ms, and the bytes and
    GB/s where the trace gives them."""
    groups: dict[str, list[Event]] = {}
    for ev in events:
        groups.setdefault(ev.name, []).append(ev)
    rows = []
    for name, evs in groups.items():
        total = sum(e.end - e.start for e in evs)
        known = [e.bytes for e in evs if e.bytes is not None]
        nbytes = sum(known) if known else None
        gb_s = nbytes / total if nbytes and total else None  # bytes per ns = GB/s
        rows.append({"name": name, "count": len(evs), "total_ms": total / 1e6, "bytes": nbytes,
                     "gb_s": gb_s})  # fmt: skip
    rows.sort(key=lambda r: -r["total_ms"])
    return rows[:top]


def split_steps(
    events: Sequence[Event], steps: Sequence[tuple[str, float, float]]
) -> list[tuple[str, float, float, list[Event]]]:
    """Each step's ``(name, start, end, events)``: the events that begin between its
    annotation's start and the next one's (the last step: up to the last event)."""
    if not steps:
        start, end = min(e.start for e in events), max(e.end for e in events)
        return [("window", start, end, list(events))]
    out = []
    for i, (name, start, end) in enumerate(steps):
        upto = steps[i + 1][1] if i + 1 < len(steps) else float("inf")
        out.append((name, start, end, [e for e in events if start <= e.start < upto]))
    return out


def step_rows(split: list[tuple[str, float, float, list[Event]]]) -> list[dict[str, Any]]:
    """Per step: host ms (the annotation), device busy ms, and the host gap before it."""
    rows, last_end = [], None
    for name, start, end, evs in split:
        first = min((e.start for e in evs), default=None)
        gap = (first - last_end) / 1e6 if first is not None and last_end is not None else None
        rows.append({"step": name, "host_ms": (end - start) / 1e6, "events": len(evs),
                     "device_busy_ms": busy_ns(evs) / 1e6, "gap_before_ms": gap})  # fmt: skip
        last_end = max((e.end for e in evs), default=last_end)
    return rows


def summarize(
    profile: Any, step_prefix: str = "", top: int = 10, phases: dict[str, slice] | None = None
) -> dict[str, Any]:
    """The trace's table: the plane read, the device busy fraction over the traced
    window (first step's start to last device event's end), the top kernels, each
    step's busy time and host gap; with ``phases`` (name -> slice of the steps, e.g.
    ``{"prefill": slice(0, 1), "decode": slice(1, None)}``) the same per phase."""
    trace = device_events(profile)
    if not trace.events:
        raise ValueError(f"no device events on {trace.plane}")
    steps = annotations(profile, step_prefix) if step_prefix else []
    split = split_steps(trace.events, steps)
    rows = step_rows(split)
    out = {"plane": trace.plane, "lines": trace.lines[:16], "plane_stats": trace.plane_stats,
           **_phase(split, rows, top), "steps": rows}  # fmt: skip
    for name, part in (phases or {}).items():
        if split[part]:
            out[name] = _phase(split[part], rows[part], top)
    return out


def _phase(split: list, rows: list[dict[str, Any]], top: int) -> dict[str, Any]:
    events = [e for *_, evs in split for e in evs]
    start = split[0][1]
    end = max([e.end for e in events] + [split[-1][2]])
    busy = busy_ns(events)
    gaps = [r["gap_before_ms"] for r in rows[1:] if r["gap_before_ms"] is not None]
    return {
        "steps_read": len(split),
        "window_ms": (end - start) / 1e6,
        "device_busy_ms": busy / 1e6,
        "busy_fraction": busy / (end - start) if end > start else None,
        "host_gap_ms": {"median": statistics.median(gaps), "max": max(gaps), "total": sum(gaps)}
        if gaps
        else None,  # fmt: skip
        "top_kernels": top_kernels(events, top),
    }


def _ms(value: Any, digits: int = 3) -> str:
    return "-" if not isinstance(value, (int, float)) else f"{value:,.{digits}f}"


def table(result: dict[str, Any], name_width: int = 60) -> str:
    """The summary as text: one line per phase, then each phase's top kernels."""
    from jaxengine.benchmarks.common import format_table

    phases = [(p, result[p]) for p in ("prefill", "decode") if isinstance(result.get(p), dict)]
    phases = phases or [("window", result)]
    rows = []
    for name, p in phases:
        gap = p.get("host_gap_ms") or {}
        rows.append([name, str(p["steps_read"]), _ms(p["window_ms"]), _ms(p["device_busy_ms"]),
                     _ms(p["busy_fraction"], 2), _ms(gap.get("median")),
                     _ms(gap.get("max"))])  # fmt: skip
    header = ["traced", "steps", "window ms", "device ms", "busy", "gap median ms", "gap max ms"]
    parts = [f"plane read: {result['plane']}", format_table(header, rows)]
    for name, p in phases:
        kernels = [[k["name"][:name_width], str(k["count"]), _ms(k["total_ms"]),
                    _ms(k["gb_s"], 1)] for k in p["top_kernels"]]  # fmt: skip
        parts.append(format_table([f"top kernels ({name})", "count", "total ms", "GB/s"], kernels))
    return "\n".join(parts)
