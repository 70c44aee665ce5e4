"""One engine over two JAX processes: the "mp" backend by hand, and Ray.

Each process has 4 virtual CPU devices, and a tensor-parallel-8 engine spans both
(`jax.distributed` on a local coordinator, CPU collectives through gloo). The greedy
tokens (and their logprobs) must equal one device's, computed here in the test process.

- mp: ``jaxengine serve --nnodes 2 --node-rank 0`` (the driver, HTTP on a free port)
  and ``jaxengine serve --headless --node-rank 1`` (a follower, no port); the tokens
  come back as ``token_id:N`` logprob entries. Stopping the driver stops the follower.
- ray: a local Ray cluster (``ray start --head`` on loopback), and an `LLM` with
  ``distributed_executor_backend="ray"`` in a driver process that starts two Ray
  workers of 4 devices each (``$JAXENGINE_RAY_DEVICES_PER_WORKER``).

Every child process is started in its own session and its whole group is killed at
the end, whatever happened.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from jaxengine import LLM, SamplingParams
from jaxengine.config import ParallelConfig
from jaxengine.executor.ray import worker_layout
from tests.processes import child_env, free_port, wait_healthy
from tests.sharding.conftest import ENGINE_KWARGS, PROMPTS

MAX_TOKENS = 8
LOGPROBS = 2
LOCAL_DEVICES = 4
TIMEOUT = 240  # seconds for a multi-process run to come up or finish

ENGINE_FLAGS = [
    "--skip-tokenizer-init",
    "--max-model-len", str(ENGINE_KWARGS["max_model_len"]),
    "--max-num-seqs", str(ENGINE_KWARGS["max_num_seqs"]),
    "--max-num-batched-tokens", str(ENGINE_KWARGS["max_num_batched_tokens"]),
    "--compile-token-buckets", *map(str, ENGINE_KWARGS["compile_token_buckets"]),
    "--no-enable-compilation-cache",
    "--swap-space", "0",
    "--tensor-parallel-size", "8",
]  # fmt: skip


@pytest.fixture(scope="module")
def reference(llama_dir) -> tuple[list[list[int]], list[list[dict[int, float]]]]:
    """Greedy tokens and their top logprobs on one device, in this process."""
    llm = LLM(model=llama_dir, **ENGINE_KWARGS)
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=LOGPROBS
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    llm.shutdown()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [
        [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outs
    ]
    return tokens, logprobs


def assert_logprobs_close(actual, expected) -> None:
    for got_seq, want_seq in zip(actual, expected, strict=True):
        for got, want in zip(got_seq, want_seq, strict=True):
            top = sorted(want, key=want.get, reverse=True)[:LOGPROBS]
            for token in top:
                assert got[token] == pytest.approx(want[token], abs=1e-4)


# ---------------------------------------------------------------------- mp, by hand


def completion_tokens(url: str) -> tuple[list[list[int]], list[list[dict[int, float]]]]:
    body = {
        "model": "tiny",
        "prompt": [[int(t) for t in p] for p in PROMPTS],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": LOGPROBS,
        "return_tokens_as_token_ids": True,
    }
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    tokens, logprobs = [], []
    for choice in choices:
        lp = choice["logprobs"]
        tokens.append([int(t.removeprefix("token_id:")) for t in lp["tokens"]])
        logprobs.append(
            [
                {int(t.removeprefix("token_id:")): v for t, v in top.items()}
                for top in lp["top_logprobs"]
            ]
        )
    return tokens, logprobs


@pytest.mark.slow
def test_two_processes_serve_one_tensor_parallel_engine(llama_dir, reference, children):
    coordinator, http = free_port(), free_port()
    serve = [sys.executable, "-m", "jaxengine.cli.main", "serve", llama_dir, *ENGINE_FLAGS]
    nodes = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(coordinator)]
    env = child_env(JAX_NUM_CPU_DEVICES=str(LOCAL_DEVICES))
    children.start("follower", [*serve, *nodes, "--node-rank", "1", "--headless"], env)
    driver_cmd = [*serve, *nodes, "--node-rank", "0", "--served-model-name", "tiny"]
    driver_cmd += ["--host", "127.0.0.1", "--port", str(http), "--disable-log-stats"]
    driver = children.start("driver", driver_cmd, env)
    url = f"http://127.0.0.1:{http}"
    wait_healthy(url, children, TIMEOUT)

    tokens, logprobs = completion_tokens(url)
    assert tokens == reference[0], children.logs()
    assert_logprobs_close(logprobs, reference[1])

    driver.send_signal(signal.SIGINT)  # the driver's shutdown tells the follower to stop
    assert children.wait("follower", 60) == 0, children.log("follower")
    children.wait("driver", 60)


# ---------------------------------------------------------------------- Ray

RAY_DRIVER = """
import json, sys
from jaxengine import LLM, SamplingParams
model, kwargs, prompts, max_tokens = json.loads(sys.argv[1])
llm = LLM(model=model, distributed_executor_backend="ray", tensor_parallel_size=8, **kwargs)
params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
result = {
    "tokens": [list(o.outputs[0].token_ids) for o in outs],
    "compiles_after_warmup": llm.engine.executor.compiles_after_warmup,
    "workers": len(llm.engine.executor.workers),
}
llm.shutdown()
print("RESULT " + json.dumps(result), flush=True)
"""


@pytest.fixture
def ray_cluster(children):
    """A one-node Ray cluster on loopback (4 CPUs, no dashboard); its address."""
    ray = Path(sys.executable).with_name("ray")
    if not ray.exists() or shutil.which("ray", path=str(ray.parent)) is None:
        pytest.skip("ray is not installed (pip install 'jaxengine[ray]')")
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: ray's socket paths
    cmd = [str(ray), "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port)]
    cmd += ["--num-cpus", "4", "--include-dashboard=false", "--disable-usage-stats"]
    cmd += ["--temp-dir", temp_dir, "--block"]
    children.start("ray", cmd, child_env())
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if children.procs["ray"].poll() is not None:
            pytest.fail(f"ray start exited\n{children.log('ray')}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            break
        time.sleep(0.5)
    yield address
    children.kill_all()
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
def test_ray_backend_drives_two_workers(llama_dir, reference, ray_cluster, children):
    kwargs = {k: v for k, v in ENGINE_KWARGS.items()}
    args = json.dumps([llama_dir, kwargs, [[int(t) for t in p] for p in PROMPTS], MAX_TOKENS])
    env = child_env(RAY_ADDRESS=ray_cluster, JAXENGINE_RAY_DEVICES_PER_WORKER=str(LOCAL_DEVICES))
    children.start("ray_driver", [sys.executable, "-c", RAY_DRIVER, args], env)
    assert children.wait("ray_driver", TIMEOUT) == 0, children.logs()
    log = (children.log_dir / "ray_driver.log").read_text()
    result = json.loads(log.split("RESULT ", 1)[1].splitlines()[0])
    assert result["workers"] == 2
    assert result["tokens"] == reference[0]
    assert result["compiles_after_warmup"] == 0


# ---------------------------------------------------------------------- no processes


def test_multi_node_flags_are_checked():
    with pytest.raises(ValueError, match="node_rank"):
        ParallelConfig(nnodes=2, node_rank=2)
    with pytest.raises(ValueError, match="nnodes"):
        ParallelConfig(nnodes=2, distributed_executor_backend="ray")
    ParallelConfig(nnodes=2, node_rank=1, distributed_executor_backend="mp")


def test_headless_needs_a_follower_rank():
    from jaxengine import EngineArgs
    from jaxengine.executor.multihost import run_follower

    with pytest.raises(ValueError, match="--headless"):
        run_follower(EngineArgs(nnodes=2, node_rank=0))


def test_ray_worker_layout(monkeypatch):
    monkeypatch.delenv("JAXENGINE_RAY_DEVICES_PER_WORKER", raising=False)
    gpu_nodes = [{"Resources": {"CPU": 32, "GPU": 8}}] * 2
    assert worker_layout(16, gpu_nodes) == (8, {"num_gpus": 8}, None)
    tpu_nodes = [{"Resources": {"CPU": 96, "TPU": 4}}] * 2
    assert worker_layout(8, tpu_nodes) == (4, {"resources": {"TPU": 4}}, None)
    cpu_nodes = [{"Resources": {"CPU": 4}}]
    assert worker_layout(8, cpu_nodes) == (8, {"num_cpus": 1}, 8)
    monkeypatch.setenv("JAXENGINE_RAY_DEVICES_PER_WORKER", "4")
    assert worker_layout(8, cpu_nodes) == (4, {"num_cpus": 1}, 4)
    monkeypatch.setenv("JAXENGINE_RAY_DEVICES_PER_WORKER", "3")
    with pytest.raises(ValueError, match="do not divide"):
        worker_layout(8, cpu_nodes)
