"""Start-up: from `jaxengine serve` to the first completed request, cold and warm.

    python -m bench.startup                    # background and blocking compiles
    python -m bench.startup --modes background --warm-runs 2

For each mode (``background``: ``--background-compile``, `serve`'s default;
``blocking``: ``--no-background-compile``) it starts `jaxengine serve` on a fresh
compilation cache directory (cold), then again on the same directory (warm, as a
restart finds it), and times each start from the process launch to:

- ``ready s``: ``GET /v1/models`` answers;
- ``first request s``: a chat completion (``--max-tokens``, greedy) has completed.

The default model's weights are already on disk (as after the first run); what is
cold is only the compilation cache. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

if __package__ in (None, ""):  # run as a file
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serve_peers import MODEL, stop_server, wait_ready
from jaxengine.benchmarks.common import describe_run, format_table, log, machine_info

MODES = {"background": "--background-compile", "blocking": "--no-background-compile"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="background,blocking", help="comma-separated")
    parser.add_argument("--warm-runs", type=int, default=1, help="warm starts per mode")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--engine-args", default="", help="extra `jaxengine serve` flags")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per start")
    parser.add_argument("--json", metavar="PATH", help="also write the results here")
    return parser


def first_request(url: str, max_tokens: int) -> str:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def one_start(mode: str, cache_dir: str, args: argparse.Namespace, log_path: Path) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "jaxengine.cli.main", "serve", MODEL, "--port", str(port),
        "--host", "127.0.0.1", "--disable-uvicorn-access-log",
        "--compilation-cache-dir", cache_dir, MODES[mode], *args.engine_args.split(),
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as out:
        start = time.perf_counter()
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_ready(url, process, args.timeout, poll=0.05)  # start-up takes seconds
            ready = time.perf_counter() - start
            text = first_request(url, args.max_tokens)
            done = time.perf_counter() - start
        finally:
            stop_server(process, grace=60)
    return {"ready_s": ready, "first_request_s": done, "text": text}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    workload = {"model": MODEL, "modes": args.modes, "max_tokens": args.max_tokens}
    print(describe_run("start-up: serve to first completed request", machine_info(), workload))
    rows, results = [], []
    with tempfile.TemporaryDirectory(prefix="jaxengine-startup-") as tmp:
        for mode in args.modes.split(","):
            cache = str(Path(tmp) / f"xla-{mode}")
            for run in ["cold"] + ["warm"] * args.warm_runs:
                log(f"{mode}, {run} compilation cache ...")
                result = one_start(mode, cache, args, Path(tmp) / f"{mode}-{run}.log")
                results.append({"mode": mode, "cache": run, **result})
                rows.append(
                    [mode, run, f"{result['ready_s']:.1f}", f"{result['first_request_s']:.1f}"]
                )
    print(format_table(["compile", "cache", "ready s", "first request s"], rows))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
