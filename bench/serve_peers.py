"""The serving benchmark against each peer's server, one after another, in one run.

    python -m bench.serve_peers --num-prompts 200 --max-concurrency 32 \\
        --random-input-len 128 --random-output-len 128 --ignore-eos

For each peer it starts the server on a free local port with the default model,
waits until ``GET /v1/models`` answers, runs `jaxengine.benchmarks.serve` with the given flags (the
same prompts: same seed and tokenizer), stops the server, and finally prints one
table with the peers' figures and their ratios to jaxengine. Peers:

- ``jaxengine``: ``jaxengine serve`` (plus ``--engine-args``); ``jaxengine-async``
  the same with ``--async-scheduling``;
- ``llama.cpp``: ``python -m llama_cpp.server`` on the same GGUF file, when
  llama-cpp-python is installed with its server extra; it runs one sequence at a
  time (no continuous batching), so concurrent requests queue (with
  ``--interrupt_requests False``; by default a new request cuts the running one). Its server has no
  ``ignore_eos``: with ``--ignore-eos`` it gets a -100 logit bias on the model's
  end-of-sequence tokens instead, so both peers generate the same lengths.

Every flag this script does not know goes to `jaxengine.benchmarks.serve` unchanged.
"""

from __future__ import annotations

import argparse
import json
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

if __package__ in (None, ""):  # run as a file
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxengine.benchmarks.common import describe_run, format_table, log, machine_info
from jaxengine.benchmarks.serve import main as serve_main

PEERS = ("jaxengine", "jaxengine-async", "llama.cpp")
MODEL = "SmolLM2-135M-Instruct"
COLUMNS = (  # (header, result key, digits)
    ("ok/failed", None, 0),
    ("req/s", "request_throughput", 2),
    ("out tok/s", "output_throughput", 1),
    ("mean TTFT ms", "mean_ttft_ms", 0),
    ("median TPOT ms", "median_tpot_ms", 0),
    ("p99 ITL ms", "p99_itl_ms", 0),
    ("mean E2EL ms", "mean_e2el_ms", 0),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated peers")
    parser.add_argument("--engine-args", default="", help="extra `jaxengine serve` flags")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds")
    parser.add_argument("--json", metavar="PATH", help="also write the results here")
    return parser


def server_command(peer: str, port: int, gguf: Path, args: argparse.Namespace) -> list[str]:
    if peer in ("jaxengine", "jaxengine-async"):
        cmd = [sys.executable, "-m", "jaxengine.cli.main", "serve", MODEL, "--port", str(port)]
        cmd += ["--async-scheduling"] if peer == "jaxengine-async" else []
        return (
            cmd
            + ["--host", "127.0.0.1", "--disable-uvicorn-access-log"]
            + shlex.split(args.engine_args)
        )
    if peer == "llama.cpp":
        return [
            sys.executable, "-m", "llama_cpp.server", "--model", str(gguf),
            "--model_alias", MODEL, "--host", "127.0.0.1", "--port", str(port),
            "--n_ctx", "4096", "--n_threads", str(args.threads), "--verbose", "False",
            "--interrupt_requests", "False",  # else a new request cuts the running one
        ]  # fmt: skip
    raise SystemExit(f"unknown peer {peer!r}; choose from {', '.join(PEERS)}")


def wait_ready(url: str, process: subprocess.Popen, timeout: float, poll: float = 1.0) -> None:
    """Polls ``GET /v1/models`` every ``poll`` seconds until it answers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(poll)
    raise RuntimeError(f"server not ready after {timeout:.0f}s")


def eos_bias(gguf: Path) -> dict[str, float]:
    """A -100 logit bias on the model's end-of-sequence and other special tokens
    (llama.cpp ends generation on any end-of-generation token, not only EOS)."""
    from jaxengine.loader.hf_config import load_generation_config
    from jaxengine.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(gguf)
    ids = {tokenizer.eos_token_id, *tokenizer.all_special_ids}
    eos = load_generation_config(gguf).get("eos_token_id")
    ids |= set(eos) if isinstance(eos, list) else {eos}
    return {str(i): -100.0 for i in sorted(i for i in ids if i is not None)}


def run_peer(peer: str, gguf: Path, args, serve_argv: list[str], out_dir: Path) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_file = open(out_dir / f"{peer}.log", "w")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        server_command(peer, port, gguf, args), stdout=log_file, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, process, args.startup_timeout)
        log(f"{peer}: server ready at {url}")
        argv = [*serve_argv, "--base-url", url, "--model", MODEL, "--tokenizer", MODEL]
        if peer == "llama.cpp" and "--ignore-eos" in serve_argv:
            argv += ["--extra-body", json.dumps({"logit_bias": eos_bias(gguf)})]
        argv += ["--save-result", "--result-dir", str(out_dir), "--result-filename"]
        status = serve_main([*argv, f"{peer}.json"])
        if status != 0:
            return {"peer": peer, "error": f"jaxengine.benchmarks.serve exited with {status}"}
        return {"peer": peer, **json.loads((out_dir / f"{peer}.json").read_text())}
    except RuntimeError as e:
        return {"peer": peer, "error": f"{e} (log: {out_dir / (peer + '.log')})"}
    finally:
        stop_server(process)
        log_file.close()


def stop_server(process: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited after ``grace`` seconds."""
    process.terminate()
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()


def render(results: list[dict]) -> str:
    base = next((r for r in results if r["peer"] == "jaxengine" and "error" not in r), None)
    header = ["peer", *(c[0] for c in COLUMNS), "out tok/s vs jaxengine"]
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["peer"], f"unavailable: {r['error']}"] + [""] * len(COLUMNS))
            continue
        cells = [f"{r['completed']}/{r['failed']}"]
        cells += [f"{r[key]:.{digits}f}" for _, key, digits in COLUMNS[1:]]
        versus = "-"
        if base and base["output_throughput"]:
            versus = f"{r['output_throughput'] / base['output_throughput']:.2f}x"
        rows.append([r["peer"], *cells, versus])
    return format_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    args, serve_argv = build_parser().parse_known_args(argv)
    from jaxengine.loader.demo import ensure_demo_model

    gguf = ensure_demo_model(MODEL)
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    machine = machine_info()  # before the run: its load average is the idle one
    with tempfile.TemporaryDirectory(prefix="serve-peers-") as tmp:
        results = [run_peer(peer, gguf, args, serve_argv, Path(tmp)) for peer in peers]
    workload = {"peers": ",".join(peers), "jaxengine.benchmarks.serve": shlex.join(serve_argv)}
    print(describe_run("serving benchmark", machine, workload))
    print(render(results))
    if args.json:
        doc = {"machine": machine, "argv": sys.argv, "results": results}
        Path(args.json).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return 0 if any("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
