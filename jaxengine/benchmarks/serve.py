"""Online serving benchmark: requests streamed to a running OpenAI-compatible server.

    jaxengine serve SmolLM2-135M-Instruct &        # or any OpenAI-compatible server
    python -m jaxengine.benchmarks.serve --num-prompts 200 --request-rate 8 --random-input-len 256
    jaxengine bench serve ...                       # the same, through the CLI

The client side of vLLM's ``vllm bench serve``, with its flags and its report. Requests
arrive as a Poisson process (``--request-rate``; ``--burstiness`` is the shape of the
gamma-distributed gaps; ``inf`` sends all at once), at most ``--max-concurrency`` in
flight. Each is a streamed ``/v1/completions`` (or ``/v1/chat/completions``) request;
the client records TTFT, ITL, end-to-end latency and output tokens, and prints
throughput and latency statistics (``--save-result``: also as JSON).

The pieces live in sibling modules that tests use without a server:
`serve_datasets` (random and ShareGPT prompts, arrival times; why random prompts
are sent as text, not token ids, is said there), `serve_client` (streamed
requests and their timing) and `serve_metrics` (figures and report). This module
holds the flags and the run: resolve the URLs and the model (first of ``GET
/v1/models``), load the tokenizer (``--tokenizer``, default the model name, resolved
like a model: a demo name, a path or a hub id), sample the prompts, send one test
request (its failure ends the run with its error), then time the whole run.

Module level imports only the standard library (numpy, httpx, tqdm and the tokenizer
come when the benchmark runs), so building the CLI parser stays instant.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: python jaxengine/benchmarks/serve.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from jaxengine.benchmarks.common import json_object, log, positive_int
from jaxengine.benchmarks.serve_client import (
    RequestResult,
    build_payload,
    run_requests,
    send_request,
)
from jaxengine.benchmarks.serve_datasets import (
    SampleRequest,
    arrival_times,
    sample_random,
    sample_sharegpt,
)
from jaxengine.benchmarks.serve_metrics import METRICS, aggregate, format_report

DEFAULT_ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
"""--backend -> the --endpoint it implies."""


class BenchError(Exception):
    """A setup problem, reported as one line (no traceback)."""


# --------------------------------------------------------------------------- arguments


def parse_metric_names(text: str) -> list[str]:
    """``"ttft,tpot"`` -> ["ttft", "tpot"]; names from METRICS."""
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in METRICS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(METRICS)}; got {text!r}")
    return names


def parse_percentiles(text: str) -> list[float]:
    """``"50,90,99.9"`` -> [50.0, 90.0, 99.9], each in (0, 100]."""
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from e
    if not values or any(not 0 < p <= 100 for p in values):
        raise argparse.ArgumentTypeError(f"percentiles must be in (0, 100]; got {text!r}")
    return values


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Adds this benchmark's flags (vLLM's names) to ``parser``."""
    _add_server_args(parser.add_argument_group("server"))
    _add_dataset_args(parser.add_argument_group("dataset"))
    _add_traffic_args(parser.add_argument_group("traffic and sampling"))
    _add_output_args(parser.add_argument_group("report"))


def _add_server_args(group: Any) -> None:
    add = group.add_argument
    add(
        "--backend",
        choices=list(DEFAULT_ENDPOINTS),
        default="openai",
        help="API flavour; picks the default --endpoint (default: %(default)s)",
    )
    add("--base-url", default=None, help="server URL, e.g. http://host:8000 (overrides --host)")
    add("--host", default="127.0.0.1", help="server host (default: %(default)s)")
    add("--port", type=int, default=8000, help="server port (default: %(default)s)")
    add(
        "--endpoint",
        default=None,
        help="API path: /v1/completions (default) or /v1/chat/completions",
    )
    add("--model", default=None, help="model name (default: the first of GET /v1/models)")
    add("--tokenizer", default=None, help="tokenizer name or path (default: the model name)")
    add(
        "--api-key",
        default=None,
        help="bearer key (default: $OPENAI_API_KEY, else $JAXENGINE_API_KEY)",
    )


def _add_dataset_args(group: Any) -> None:
    add = group.add_argument
    add(
        "--dataset-name",
        choices=["random", "sharegpt"],
        default="random",
        help="where prompts come from (default: %(default)s)",
    )
    add("--dataset-path", default=None, help="ShareGPT JSON file (for --dataset-name sharegpt)")
    add("--num-prompts", type=positive_int, default=1000, help="requests (default: %(default)s)")
    add("--random-input-len", type=positive_int, default=1024, help="prompt tokens (random)")
    add("--random-output-len", type=positive_int, default=128, help="output tokens (random)")
    add(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths drawn uniformly in len * [1 - r, 1 + r], 0 <= r < 1 (default: 0)",
    )
    add("--random-prefix-len", type=int, default=0, help="shared random prefix tokens")
    add(
        "--sharegpt-output-len",
        type=positive_int,
        default=None,
        help="output tokens of every ShareGPT request (default: the reply's length)",
    )
    add("--seed", type=int, default=0, help="seed of prompts and arrivals (default: 0)")


def _add_traffic_args(group: Any) -> None:
    add = group.add_argument
    add(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second, Poisson arrivals (default: inf, all at once)",
    )
    add(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps: 1 = Poisson, < 1 burstier (default: 1)",
    )
    add("--max-concurrency", type=positive_int, default=None, help="most requests in flight")
    add("--ignore-eos", action="store_true", help="generate max_tokens whatever the model says")
    add("--temperature", type=float, default=0.0, help="sampling temperature (default: greedy)")
    add("--top-p", type=float, default=None, help="nucleus sampling mass (default: server's)")
    add("--top-k", type=int, default=None, help="top-k sampling (default: server's)")
    add(
        "--extra-body",
        type=json_object,
        default=None,
        metavar="JSON",
        help='fields merged into every request body, e.g. \'{"logit_bias": {"2": -100}}\'',
    )


def _add_output_args(group: Any) -> None:
    add = group.add_argument
    add("--disable-tqdm", action="store_true", help="no progress bar")
    add(
        "--percentile-metrics",
        type=parse_metric_names,
        default=["ttft", "tpot", "itl"],
        help="metrics shown with percentiles, of ttft,tpot,itl,e2el (default: ttft,tpot,itl)",
    )
    add(
        "--metric-percentiles",
        type=parse_percentiles,
        default=[99.0],
        help="comma-separated percentiles, e.g. 50,90,99 (default: 99)",
    )
    add("--save-result", action="store_true", help="write the results as JSON")
    add("--save-detailed", action="store_true", help="with per-request figures and texts")
    add("--result-dir", default=None, help="folder of the JSON (default: the current one)")
    add(
        "--result-filename",
        default=None,
        help="JSON file name (default: BACKEND-RATEqps[-concurrencyN]-MODEL-DATE.json)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jaxengine.benchmarks.serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_cli_args(parser)
    return parser


# --------------------------------------------------------------------------- running


@dataclass(frozen=True)
class Target:
    """Where the requests go."""

    api_url: str
    models_url: str
    chat: bool
    backend: str
    """"openai" or "openai-chat", from the endpoint actually used."""


def resolve_target(args: argparse.Namespace) -> Target:
    """URLs from --base-url (or --host/--port), --endpoint and --backend."""
    endpoint = args.endpoint or DEFAULT_ENDPOINTS[args.backend]
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    if base.endswith("/v1") and endpoint.startswith("/v1/"):
        base = base[: -len("/v1")]  # --base-url http://host:8000/v1 is meant the same
    chat = endpoint.rstrip("/").endswith("/chat/completions")
    if args.backend == "openai-chat" and not chat:
        raise BenchError(f"--backend openai-chat needs a chat endpoint, not {endpoint}")
    backend = "openai-chat" if chat else "openai"
    return Target(base + endpoint, base + "/v1/models", chat, backend)


def auth_headers(api_key: str | None) -> dict[str, str]:
    key = api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("JAXENGINE_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def first_model(models_url: str, headers: dict[str, str]) -> str:
    """The id of the first model the server lists."""
    import httpx

    try:
        response = httpx.get(models_url, headers=headers, timeout=30.0)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except httpx.HTTPError as e:
        raise BenchError(f"cannot list the server's models at {models_url}: {e}") from e
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise BenchError(f"{models_url} gave no model list ({e!r}); pass --model") from e


def load_tokenizer(name: str) -> Any:
    """The tokenizer of ``name`` (a demo model name, a path or a hub id)."""
    from jaxengine.loader.sources import resolve_model
    from jaxengine.tokenizer import get_tokenizer

    try:
        return get_tokenizer(resolve_model(name))
    except Exception as e:  # noqa: BLE001 - any failure here is a setup problem
        raise BenchError(f"cannot load the tokenizer {name!r} ({e}); pass --tokenizer") from e


def sample_requests(args: argparse.Namespace, tokenizer: Any) -> list[SampleRequest]:
    """The dataset's requests (``--dataset-name``)."""
    try:
        if args.dataset_name == "sharegpt":
            if not args.dataset_path:
                raise BenchError("--dataset-name sharegpt needs --dataset-path")
            return sample_sharegpt(
                args.dataset_path, tokenizer, args.num_prompts, args.seed, args.sharegpt_output_len
            )
        return sample_random(
            tokenizer,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.random_prefix_len,
            args.seed,
        )
    except (OSError, ValueError) as e:
        raise BenchError(f"cannot sample the {args.dataset_name} dataset: {e}") from e


def sampling_fields(args: argparse.Namespace) -> dict[str, Any]:
    """Request fields beyond prompt and length: temperature, top_p, top_k, ignore_eos,
    and ``--extra-body``."""
    fields: dict[str, Any] = {"temperature": args.temperature}
    if args.top_p is not None:
        fields["top_p"] = args.top_p
    if args.top_k is not None:
        fields["top_k"] = args.top_k
    if args.ignore_eos:
        fields["ignore_eos"] = True
    return fields | (args.extra_body or {})


async def benchmark(
    target: Target,
    payloads: list[dict[str, Any]],
    requests: list[SampleRequest],
    arrivals: list[float],
    args: argparse.Namespace,
    headers: dict[str, str],
) -> tuple[list[RequestResult], float]:
    """One test request, then the timed run."""
    import httpx
    from tqdm import tqdm

    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=None)
    timeout = httpx.Timeout(None, connect=30.0)  # generations may take long; connects not
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def send(i: int) -> RequestResult:
            prompt_len = requests[i].prompt_len
            return await send_request(
                client, target.api_url, payloads[i], target.chat, prompt_len, headers
            )

        log("starting the initial single-prompt test run")
        test = await send(0)
        if not test.success:
            raise BenchError(f"the initial test request failed: {test.error}")
        log(
            f"test run done; {len(payloads)} requests, rate {args.request_rate}/s, "
            f"burstiness {args.burstiness}, max concurrency {args.max_concurrency}"
        )
        with tqdm(total=len(payloads), disable=args.disable_tqdm) as progress:
            return await run_requests(send, arrivals, args.max_concurrency, progress)


def _raise_open_file_limit() -> None:
    """Soft limit of open files up to the hard one: each request in flight is a socket."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):  # not Unix, or not allowed: keep the limit
        pass


def count_missing_output_tokens(results: list[RequestResult], tokenizer: Any) -> None:
    """Output tokens by the tokenizer where the server sent no usage."""
    for r in results:
        if r.success and r.output_tokens is None:
            r.output_tokens = len(tokenizer.encode(r.text, add_special_tokens=False))


def _json_safe(value: Any) -> Any:
    return "inf" if isinstance(value, float) and math.isinf(value) else value


def result_document(
    args: argparse.Namespace,
    target: Target,
    model: str,
    metrics: dict[str, Any],
    results: list[RequestResult],
    command: str,
) -> dict[str, Any]:
    """What ``--save-result`` writes: vLLM's keys, plus the whole config and command."""
    doc: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": target.backend,
        "endpoint": target.api_url,
        "model_id": model,
        "tokenizer_id": args.tokenizer or model,
        "num_prompts": args.num_prompts,
        "request_rate": _json_safe(args.request_rate),
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        **metrics,
        "command": command,
        "config": {k: _json_safe(v) for k, v in sorted(vars(args).items())},
    }
    if args.save_detailed:
        doc["input_lens"] = [r.prompt_len for r in results]
        doc["output_lens"] = [r.output_tokens for r in results]
        doc["ttfts"] = [r.ttft for r in results]
        doc["itls"] = [r.itl for r in results]
        doc["generated_texts"] = [r.text for r in results]
        doc["errors"] = [r.error for r in results]
    return doc


def save_result(doc: dict[str, Any], args: argparse.Namespace) -> Path:
    name = args.result_filename
    if name is None:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        model = str(doc["model_id"]).rstrip("/").split("/")[-1]
        name = f"{doc['backend']}-{args.request_rate}qps{concurrency}-{model}-{doc['date']}.json"
    path = Path(args.result_dir or ".") / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def run(args: argparse.Namespace, command: str = "python -m jaxengine.benchmarks.serve") -> int:
    """Runs the benchmark for parsed ``args``; returns the exit status."""
    try:
        return _run(args, command)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1


def _run(args: argparse.Namespace, command: str) -> int:
    target = resolve_target(args)
    headers = auth_headers(args.api_key)
    model = args.model or first_model(target.models_url, headers)
    log(f"model {model!r}, endpoint {target.api_url}")
    tokenizer = load_tokenizer(args.tokenizer or model)
    requests = sample_requests(args, tokenizer)
    sampling = sampling_fields(args)
    payloads = [build_payload(r, model, target.chat, sampling) for r in requests]
    try:
        arrivals = arrival_times(len(requests), args.request_rate, args.burstiness, args.seed)
    except ValueError as e:
        raise BenchError(str(e)) from e
    _raise_open_file_limit()
    results, duration = asyncio.run(benchmark(target, payloads, requests, arrivals, args, headers))
    count_missing_output_tokens(results, tokenizer)
    metrics = aggregate(results, duration, args.metric_percentiles)
    selected, percentiles = args.percentile_metrics, args.metric_percentiles
    report = format_report(metrics, selected, percentiles, args.request_rate, args.max_concurrency)
    print(report, flush=True)
    errors = [r.error for r in results if not r.success]
    if errors:
        log(f"{len(errors)} requests failed, e.g.: {errors[0]}")
    if args.save_result:
        path = save_result(result_document(args, target, model, metrics, results, command), args)
        log(f"results written to {path}")
    return 0 if metrics["completed"] else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    return run(args, shlex.join(["python", "-m", "jaxengine.benchmarks.serve", *argv]))


if __name__ == "__main__":
    sys.exit(main())
