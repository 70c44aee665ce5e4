"""The run's tables, one per section plus the goals, from the JSON document alone
(so ``python -m bench.device --report FILE`` prints a saved run again)."""

from __future__ import annotations

from typing import Any

from bench.device import trace
from jaxengine.benchmarks.common import fmt, format_table

GOALS = (
    # (name, section, item, key, target, at least (True) or exactly (False))
    ("batch-1 decode MBU (read probe)", "engine", "decode", "mbu_read_probe", 0.85, True),
    ("batch-1 decode MBU (sheet)", "engine", "decode", "mbu_sheet", 0.85, True),
    ("decode attention / copy bandwidth", "kernels", "decode", "of_copy", 0.70, True),
    ("prefill attention / matmul peak", "kernels", "prefill", "of_matmul", 0.50, True),
    ("compilations after warm-up", "engine", "compiles_after_warmup", "total", 0, False),
)


def status(result: Any) -> str | None:
    """``error: ...`` / ``skipped: ...`` / ``missing`` for an item that has no figures
    (failed, out of time, or never reached), else None."""
    if not isinstance(result, dict) or not result:
        return "missing"
    for key in ("error", "skipped"):
        if isinstance(result.get(key), str):  # (pytest's counts have a "skipped" number)
            return f"{key}: {(result[key].splitlines() or [''])[0][:100]}"
    return None


def num(result: dict, key: str, digits: int = 2) -> str:
    """``result[key]`` for a table cell: a number formatted, anything else as text."""
    value = result.get(key) if isinstance(result, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-" if value is None else str(value)
    return str(value) if isinstance(value, int) else fmt(value, digits)


def environment(doc: dict) -> str:
    env = doc.get("environment", {})
    v, d = env.get("versions", {}), env.get("devices", {})
    rows = [[name, str(value)] for name, value in v.items() if isinstance(value, str)]
    if not status(d):
        limits = [m.get("bytes_limit") for m in d.get("memory", []) if m.get("bytes_limit")]
        memory = ", ".join(f"{b / 2**30:.1f} GiB" for b in limits) or "not reported"
        rows += [["device", f"{d['count']} x {d['kind']} ({d['backend']})"],
                 ["memory limit", memory], ["nvidia-smi", str(d.get("nvidia_smi"))]]  # fmt: skip
    for name, item, key in (("copy GB/s", "copy", "copy_gb_s"),
                            ("read GB/s (float32 sum of bf16)", "read", "read_gb_s"),
                            ("bf16 matmul TFLOP/s", "matmul", "matmul_tflop_s")):  # fmt: skip
        result = env.get(item, {})
        rows.append([name, status(result) or num(result, key, 3 if "TFLOP" in name else 1)])
    rows.append(["sheet", sheet_text(env.get("sheet"))])
    return format_table(["environment", "value"], rows)


def sheet_text(sheet: Any) -> str:
    if sheet is None:
        return "none for this device kind"
    if status(sheet):
        return status(sheet) or ""
    return (f"{sheet['chip']}: {num(sheet, 'sheet_gb_s', 0)} GB/s, bf16 "
            f"{num(sheet, 'sheet_bf16_tflop_s', 0)} TFLOP/s, fp8 "
            f"{num(sheet, 'sheet_fp8_tflop_s', 0)} TFLOP/s")  # fmt: skip


def mbu(r: dict) -> str:
    """The MBUs of a decode result: sheet / read probe / copy probe."""
    return "MBU " + " / ".join(num(r, f"mbu_{k}") for k in ("sheet", "read_probe", "copy_probe"))


def correctness(doc: dict) -> str:
    sec = doc.get("correctness", {})
    rows = []
    for family in ("llama", "qwen3", "gemma3"):
        r = sec.get(family, {})
        bad = status(r)
        rows.append([family, bad or r["architecture"], num(r, "float32_match"),
                     num(r, "float32_equal_fraction"), num(r, "bf16_agreement"),
                     num(r, "bf16_equal_fraction")])  # fmt: skip
    header = ["tiny family", "model", "float32 = transformers", "float32 equal",
              "bf16 agreement", "bf16 equal"]  # fmt: skip
    py = sec.get("pytest_gpu", {})
    counts = status(py) or ", ".join(
        f"{py.get(k, '-')} {k}" for k in ("passed", "failed", "errors", "skipped")
    )
    line = f"pytest -m gpu tests/kernels: {counts} ({num(py, 'seconds', 1)} s"
    line += ", timed out)" if py.get("timed_out") else ")"
    failures = py.get("failures") or []
    return format_table(header, rows) + "\n" + line + "".join(f"\n  failed: {f}" for f in failures)


def kernels(doc: dict) -> str:
    sec = doc.get("kernels", {})
    rows = []
    for name in ("decode", "prefill", "mixed"):
        r = sec.get(name, {})
        if status(r):
            rows.append([name, "-", "-", "-", "-", "-", "-", status(r)])
            continue
        for peer in ("engine", "reference"):
            p = r.get(peer, {})
            notes = status(p) or ""
            if peer == "engine" and not notes:
                notes = f"{r['backend']}; max |err| {num(r, 'max_err', 4)}; "
                notes += f"{num(r, 'engine_over_reference', 1)}x reference"
            rows.append([name, peer, num(p, "us", 1), num(p, "gb_s", 1), num(p, "of_copy"),
                         num(p, "tflop_s"), num(p, "of_matmul"), notes])  # fmt: skip
    header = ["attention", "peer", "us", "GB/s", "of copy", "TFLOP/s", "of matmul", "notes"]
    text = format_table(header, rows)
    for name in ("prefill", "mixed"):
        if f"sweep_{name}" in sec:
            text += f"\n\nblock sweep, {name} (Pallas GPU kernel):\n" + sweep(sec[f"sweep_{name}"])
    return text


def sweep(r: dict) -> str:
    """`bench.device.sweep`'s rows: one per config that ran, then the best."""
    if status(r):
        return status(r) or ""
    rows = []
    for c in r["rows"]:
        note = c.get("error", "")[:80] or ("" if c.get("ok") else "over MAX_ERR: not timed")
        rows.append([c["config"], c["path"], num(c, "us", 1), num(c, "tflop_s", 1),
                     num(c, "of_sheet"), num(c, "of_matmul"), num(c, "max_err", 4),
                     num(c, "seconds", 1), note])  # fmt: skip
    header = ["config", "KV path", "us", "TFLOP/s", "of sheet", "of matmul", "max |err|", "s",
              "notes"]  # fmt: skip
    tail = f"best: {r.get('best')}; {r.get('ran')} of {r.get('planned')} configs ran"
    tail += f" ({r['stopped']})" if r.get("stopped") else ""
    tail += f"; sheet bf16 peak {num(r, 'peak_tflop_s', 0)} TFLOP/s"
    return format_table(header, rows) + "\n" + tail


def goals(doc: dict) -> str:
    rows = []
    for name, section, item, key, target, at_least in GOALS:
        r = doc.get(section, {}).get(item, {})
        if section == "kernels" and not status(r):
            r = r.get("engine", {})  # the engine's attention path, not the reference
        value = r.get(key) if isinstance(r, dict) else None
        if isinstance(value, (int, float)):
            met = value >= target if at_least else value == target
            rows.append([name, (">= " if at_least else "== ") + str(target), num(r, key),
                         "yes" if met else "NO"])  # fmt: skip
        else:
            rows.append([name, str(target), status(r) or "-", "-"])
    return format_table(["goal", "target", "measured", "met"], rows)


def engine(doc: dict) -> str:
    sec = doc.get("engine", {})
    rows = []
    for label, item, build in ENGINE_ROWS:
        r = sec.get(item, {})
        rows.append([label, status(r) or "", "", ""] if status(r) else [label, *build(r)])
    c = sec.get("compiles_after_warmup", {})
    per = ", ".join(f"{k} {'-' if v is None else v}" for k, v in c.get("per_engine", {}).items())
    rows.append(["compilations after warm-up", num(c, "total", 0), "", per])
    m = sec.get("model", {})
    title = f"model: {m.get('num_hidden_layers', '?')} layers, hidden {m.get('hidden_size')}"
    title += "; MBU against the sheet / read probe / copy probe, MFU against sheet / matmul"
    text = title + "\n" + format_table(["engine", "figure", "ratio", "notes"], rows)
    t = sec.get("trace")
    if t is not None:
        text += "\n\nprofile of the base engine (one prefill step, batch-1 decode steps):\n"
        text += status(t) or trace.table(t)
    return text


def peer(doc: dict) -> str:
    sec = doc.get("peer", {})
    b = sec.get("build", {})
    rows = [["build s", status(b) or num(b, "build_s", 1), "",
             "" if status(b) else f"{b['device']}; {b['note']}; torch {b['torch']}, "
             f"transformers {b['transformers']}"]]  # fmt: skip
    for label, item, key, digits in (("batch-1 decode tok/s", "decode", "tok_s", 1),
                                     ("TTFT s", "prefill", "ttft_s", 3)):  # fmt: skip
        r = sec.get(item, {})
        note = "" if status(r) else "jaxengine over transformers (speed)"
        rows.append([label, status(r) or num(r, key, digits), num(r, "engine_over_peer"), note])
    return format_table(["transformers peer", "figure", "jaxengine x", "notes"], rows)


ENGINE_ROWS = (
    ("start-up (cold / warm s)", "startup",
     lambda r: [f"{num(r, 'cold_s', 1)} / {num(r, 'warm_s', 1)}", "", "engine build, bf16"]),
    ("batch-1 decode tok/s", "decode",
     lambda r: [num(r, "tok_s", 1), mbu(r), f"{num(r, 'weight_gib')} GiB"]),
    ("throughput out tok/s", "throughput",
     lambda r: [num(r, "out_tok_s", 1), "",
                f"{r['prompts']} x {r['input_len']} in / {r['output_len']} out, "
                f"{num(r, 'total_tok_s', 1)} total tok/s"]),
    ("TTFT s", "ttft",
     lambda r: [num(r, "ttft_s", 3), f"MFU {num(r, 'mfu_sheet')} / {num(r, 'mfu_matmul_probe')}",
                f"{r['prompt_len']}-token prompt, {num(r, 'tflop_s', 1)} TFLOP/s"]),
    ("synchronous steps decode tok/s", "sync",
     lambda r: [num(r, "tok_s", 1), f"{num(r, 'over_base')}x", "vs the default (async on GPU)"]),
    ("fp8 weights decode tok/s", "fp8_weights",
     lambda r: [num(r, "tok_s", 1), f"{num(r, 'over_base')}x", mbu(r)]),
    ("int8 weights decode tok/s", "int8_weights",
     lambda r: [num(r, "tok_s", 1), f"{num(r, 'over_base')}x", mbu(r)]),
    ("fp8 KV cache decode tok/s", "fp8_kv_cache",
     lambda r: [num(r, "tok_s", 1), f"{num(r, 'over_base')}x", "vs bf16 cache"]),
    ("n-gram speculation out tok/s", "ngram",
     lambda r: [num(r, "tok_s", 1), f"{num(r, 'over_none')}x",
                f"acceptance {num(r, 'acceptance')}, length "
                f"{num(r, 'mean_acceptance_length')}, same tokens {r['same_tokens_as_none']}"]),
    ("4 LoRA adapters out tok/s", "lora",
     lambda r: [num(r, "tok_s", 1), f"{num(r, 'over_base')}x",
                f"{r['prompts']} prompts, rank {r['rank']}, vs no adapter"]),
)  # fmt: skip


def tables(doc: dict) -> str:
    parts = [("environment", environment), ("correctness", correctness),
             ("kernels", kernels), ("engine", engine), ("peer", peer)]  # fmt: skip
    out = []
    for name, fn in (p for p in parts if p[0] in doc):
        text = f"== {name} ==\n{fn(doc)}"
        if broken := doc[name].get("error"):  # the section itself stopped, not one item
            text += f"\nsection error: {broken}"
        out.append(text)
    out.append(f"== goals ==\n{goals(doc)}")
    return "\n\n".join(out)
