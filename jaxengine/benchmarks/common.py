"""Shared pieces of the offline benchmarks: arguments, workload, machine, results, tables.

The workload is the same for every peer: prompts of random token ids drawn from a
seeded generator over the model's ordinary tokens (control and special tokens are
left out, so no prompt contains an EOS or a chat marker), fed as ids (no tokenizer, no
BOS added), decoded greedily for exactly ``output_len`` tokens whatever the model
emits (vLLM's ``ignore_eos``).

Nothing here imports jax, torch or llama_cpp: the peers load them when they run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

# numpy is imported inside the functions that use it, so that building the parsers
# (`jaxengine bench ... --help`) imports nothing heavy.

BACKENDS = ("jaxengine", "jaxengine_async", "transformers", "llamacpp")
"""Every peer, in the default run order."""
BASELINE = "transformers"
"""The peer that ratios are taken against."""
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
PERCENTILES = (10, 25, 50, 75, 90, 99)
_VERSIONED = ("jaxengine", "jax", "jaxlib", "flax", "numpy", "torch", "transformers")
_VERSIONED += ("llama_cpp_python",)


# --------------------------------------------------------------------------- arguments


def default_threads() -> int:
    """CPU cores this process may run on (what torch and llama.cpp are given)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def parse_backends(text: str) -> list[str]:
    """``"all"`` or a comma-separated subset of BACKENDS, in the order given."""
    if text.strip().lower() == "all":
        return list(BACKENDS)
    names = [name.strip().lower().replace("-", "_") for name in text.split(",") if name.strip()]
    aliases = {"llama_cpp": "llamacpp", "hf": "transformers", "jax": "jaxengine"}
    names = [aliases.get(name, name) for name in names]
    unknown = [name for name in names if name not in BACKENDS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown backend(s) {', '.join(unknown) or '(none given)'}; "
            f"choose from {', '.join(BACKENDS)} or 'all'"
        )
    return list(dict.fromkeys(names))  # drop repeats, keep order


def json_object(text: str) -> dict[str, Any]:
    """argparse type: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def parse_engine_kwargs(text: str) -> dict[str, Any]:
    """A JSON object of LLM(...) keyword arguments; ``-`` in keys becomes ``_``."""
    return {key.replace("-", "_"): val for key, val in json_object(text).items()}


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Flags that both benchmarks share (model, peers, seed, output)."""
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="demo model name, .gguf file or Hugging Face folder (default: %(default)s)",
    )
    parser.add_argument(
        "--backends",
        type=parse_backends,
        default=list(BACKENDS),
        help="comma-separated peers to run, in order: jaxengine, transformers, llamacpp, "
        "or 'all' (default: all; a peer that cannot run here reports why)",
    )
    parser.add_argument("--input-len", type=positive_int, default=128, help="prompt tokens")
    parser.add_argument("--output-len", type=positive_int, default=128, help="tokens generated")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument(
        "--engine-kwargs",
        type=parse_engine_kwargs,
        default={},
        help='JSON object of jaxengine LLM(...) arguments, e.g. \'{"max_num_seqs": 64, '
        '"max_num_batched_tokens": 2048, "enforce_eager": true}\'',
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=default_threads(),
        help="CPU threads for torch and llama.cpp (default: cores available, %(default)s)",
    )
    parser.add_argument(
        "--llamacpp-n-batch",
        type=positive_int,
        default=512,
        help="llama.cpp n_batch: prompt tokens per forward (default: %(default)s)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results to this file")


# --------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class ModelFiles:
    """Where the benchmark model is: a .gguf file (GGUF) or a Hugging Face folder."""

    name: str
    """The name as given (jaxengine resolves it again itself)."""
    gguf: Path | None
    """The .gguf file, or None for a safetensors folder."""
    folder: Path
    """The folder holding the model files."""


def resolve_model_files(model: str) -> ModelFiles:
    """Finds the model's files with jaxengine's resolver (demo names, paths, hub ids)."""
    from jaxengine.loader.sources import resolve_model  # host code: no jax import

    source = resolve_model(model)
    return ModelFiles(model, source.gguf_file, source.path)


def token_pool(files: ModelFiles) -> np.ndarray:
    """Ids of the model's ordinary tokens, from which prompts are drawn."""
    import numpy as np

    if files.gguf is not None:
        from jaxengine.loader.gguf_io import gguf_metadata

        md = gguf_metadata(files.gguf)
        types = md.get("tokenizer.ggml.token_type")
        if types is not None:
            return np.flatnonzero(np.asarray(types) == 1)  # 1 = NORMAL in GGUF
        return np.arange(len(md["tokenizer.ggml.tokens"]))
    vocab_size = json.loads((files.folder / "config.json").read_text())["vocab_size"]
    special: set[int] = set()
    tok_json = files.folder / "tokenizer.json"
    if tok_json.is_file():
        special = {t["id"] for t in json.loads(tok_json.read_text()).get("added_tokens", [])}
    return np.array([i for i in range(vocab_size) if i not in special])


def make_prompts(
    num: int,
    input_len: int,
    pool: np.ndarray,
    seed: int | list[int],
    range_ratio: float = 0.0,
) -> list[list[int]]:
    """``num`` prompts of ids drawn uniformly from ``pool``, reproducible from ``seed``.

    With ``range_ratio`` r > 0 each length is drawn uniformly from
    [input_len * (1 - r), input_len * (1 + r)] (at least 1), as in vLLM's random dataset.
    """
    import numpy as np

    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    if range_ratio > 0:
        low = max(1, int(input_len * (1 - range_ratio)))
        high = max(low, int(input_len * (1 + range_ratio)))
        lengths = rng.integers(low, high + 1, size=num)
    else:
        lengths = np.full(num, input_len)
    return [rng.choice(pool, size=int(n)).tolist() for n in lengths]


def check_outputs(outputs: list[list[int]], output_len: int) -> list[str]:
    """Notes on outputs that do not hold exactly ``output_len`` tokens (none: all good)."""
    wrong = [len(out) for out in outputs if len(out) != output_len]
    if not wrong:
        return []
    return [f"{len(wrong)}/{len(outputs)} outputs not {output_len} tokens (e.g. {wrong[0]})"]


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> float:
    """Mean length of the common prefix with the reference's greedy output, as a fraction.

    1.0 means the same tokens everywhere. Peers that compute in other precisions
    (llama.cpp multiplies Q4_1 weights by 8-bit activations) drift after a while on
    random prompts, so this is a sanity check, not a correctness test.
    """
    import numpy as np

    fractions = []
    for out, ref in zip(outputs, reference, strict=True):
        n = 0
        for a, b in zip(out, ref, strict=False):
            if a != b:
                break
            n += 1
        fractions.append(n / max(1, len(ref)))
    return float(np.mean(fractions)) if fractions else 0.0


def percentiles(values: list[float]) -> dict[str, float]:
    """``{"p10": ..., "p25": ..., ...}`` of ``values`` (linear interpolation)."""
    import numpy as np

    points = np.percentile(np.asarray(values, dtype=float), PERCENTILES)
    return {f"p{p}": float(v) for p, v in zip(PERCENTILES, points, strict=True)}


# --------------------------------------------------------------------------- results


@dataclass
class PeerResult:
    """What one peer measured, or why it did not run."""

    backend: str
    status: str
    """"ok", "unavailable" (not installed / not implemented) or "error" (it failed)."""
    reason: str = ""
    load_s: float | None = None
    """Seconds to construct the peer (model load, and compilation for jaxengine)."""
    metrics: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    """Generated ids of the last measured batch (for agreement; not written to JSON)."""

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        del data["outputs"]
        return data


def machine_info() -> dict[str, Any]:
    """CPU, cores, memory, date, package versions and git commit of this run."""
    cpu = platform.processor() or platform.machine()
    mem_gib = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": default_threads(),
        "logical_cpus": os.cpu_count(),
        "memory_gib": mem_gib,
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {name: _version(name) for name in _VERSIONED},
        "git": _git_commit(),
    }


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _git_commit() -> str | None:
    """Short commit of the repository, with ``+dirty`` when the tree has changes."""
    repo = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=repo,
            capture_output=True,
            text=True,
        )
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def describe_run(title: str, machine: dict[str, Any], workload: dict[str, Any]) -> str:
    """The lines printed above the table: what ran, where, when, with which versions."""
    versions = ", ".join(f"{k} {v}" for k, v in machine["versions"].items())
    lines = [
        f"== {title} ==",
        f"machine:  {machine['cpu']}, {machine['cores']} cores available "
        f"({machine['logical_cpus']} logical), {machine['memory_gib']} GiB, "
        f"load average {machine['load_avg_1m']} at start",
        f"date:     {machine['date']}   git: {machine['git']}   python {machine['python']}",
        f"versions: {versions}",
        "workload: " + ", ".join(f"{k}={v}" for k, v in workload.items()),
    ]
    return "\n".join(lines)


def fmt(value: float | None, digits: int = 2) -> str:
    """A number for the table, or ``-`` when there is none."""
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def ratio(results: list[PeerResult], result: PeerResult, key: str) -> str:
    """``result``'s ``key`` over the baseline's (``1.00x`` for the baseline itself)."""
    base = next((r for r in results if r.backend == BASELINE and r.status == "ok"), None)
    value = result.metrics.get(key)
    if base is None or value is None or not base.metrics.get(key):
        return "-"
    return f"{value / base.metrics[key]:.2f}x"


def agreement_cell(results: list[PeerResult], result: PeerResult) -> str:
    """Agreement of ``result``'s outputs with the baseline's, as a percentage."""
    base = next((r for r in results if r.backend == BASELINE and r.status == "ok"), None)
    if base is None or not result.outputs or len(base.outputs) != len(result.outputs):
        return "-"
    return f"{100 * agreement(result.outputs, base.outputs):.0f}%"


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """A plain-text table: first column left-aligned, the rest right-aligned."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        parts = [
            str(c).ljust(w) if i == 0 or i == len(cells) - 1 else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def notes_cell(result: PeerResult) -> str:
    if result.status != "ok":
        return f"{result.status}: {result.reason}"
    return "; ".join(result.notes)


def write_json(
    path: str,
    benchmark: str,
    command: str,
    machine: dict[str, Any],
    workload: dict[str, Any],
    args: argparse.Namespace,
    results: list[PeerResult],
) -> None:
    """Saves everything the table shows, and more, as one JSON document."""
    doc = {
        "benchmark": benchmark,
        "command": command,
        "machine": machine,
        "workload": workload,
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "baseline": BASELINE,
        "results": [r.to_json() for r in results],
    }
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")
    log(f"results written to {path}")


def log(message: str) -> None:
    """Progress on stderr, so that stdout holds only the report."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)
