"""Serving needs no torch: the entry points do not import it, a process where torch
cannot be found serves the default model, and the paths that do need torch say so,
naming the extra (`jaxengine.extras`).

"Without torch" is a child process that cannot find it (`tests.no_torch`): transformers
then reports ``is_torch_available()`` False, as on a machine where it is not installed.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxengine.tokenizer import apply_chat_template
from tests.no_torch import TORCH_LOADED, last_json_line, run_without_torch
from tests.tiny_gguf import write_gguf

ROOT = Path(__file__).resolve().parents[2]
# what `import jaxengine`, `jaxengine.LLM` and `jaxengine serve` import before a model loads
ENTRY_POINTS = ("jaxengine", "jaxengine.entrypoints.llm", "jaxengine.cli.main",
                "jaxengine.cli.serve", "server.api_server.launch",
                "server.api_server.app")  # fmt: skip
NEEDS_TORCH = "needs PyTorch: pip install 'jaxengine[torch]'"
GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 1,
        "n_embd": 8, "n_head": 2, "vocab_size": 16, "n_positions": 64,
        "bos_token_id": 0, "eos_token_id": 0}  # fmt: skip


def test_entry_points_leave_torch_out():
    """With torch installed, importing the entry points does not import it."""
    code = (
        "import importlib, json, sys\n"
        "pulled = []\n"
        f"for name in {ENTRY_POINTS!r}:\n"
        "    importlib.import_module(name)\n"
        f"    if {TORCH_LOADED}: pulled.append(name)\n"
        "import jaxengine\n"
        "jaxengine.LLM, jaxengine.SamplingParams, jaxengine.EngineArgs\n"
        f"print(json.dumps([pulled, {TORCH_LOADED}]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [[], []]


def test_no_module_level_torch_import_outside_the_fallback():
    """torch is imported inside the functions that need it, never when a module loads."""
    found = []
    for package in ("jaxengine", "server", "sharding", "pallas_kernels"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in _module_level(ast.parse(path.read_text(), str(path))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and not node.level:
                    names = [node.module or ""]
                if any(n.partition(".")[0] == "torch" for n in names):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []


def _module_level(tree: ast.AST):
    """The import statements that run when the module loads (not inside a def)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            elif not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                todo.append(child)


@pytest.mark.slow
def test_default_model_serves_without_torch(
    smollm2_gguf, smollm2_tokenizer, tmp_path, xla_cache_dir
):
    """The default GGUF model's config and tokenizer are built, cached in a fresh
    sidecar, and `LLM` generates greedy tokens, with torch absent throughout."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    code = f"""
import json, sys
from transformers.utils import is_torch_available
assert not is_torch_available()
from jaxengine import LLM, SamplingParams
llm = LLM({str(smollm2_gguf)!r}, enforce_eager=True, max_model_len=128, max_num_seqs=2,
          max_num_batched_tokens=32, compile_token_buckets=[32], num_gpu_blocks_override=16,
          swap_space=0, compilation_cache_dir={xla_cache_dir!r})
greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
chat = llm.chat({messages!r}, greedy, use_tqdm=False)[0]
plain = llm.generate(["Paris is"], greedy, use_tqdm=False)[0]
out = [[list(o.prompt_token_ids), list(o.outputs[0].token_ids), o.outputs[0].text]
       for o in (chat, plain)]
print(json.dumps([out, {TORCH_LOADED}]))
"""
    result = run_without_torch(code, env={"JAXENGINE_CACHE": str(tmp_path)})
    (chat, plain), torch_modules = last_json_line(result)
    assert torch_modules == []
    tok = smollm2_tokenizer  # built with torch present (equal to transformers': test_gguf_config)
    assert chat[0] == apply_chat_template(tok, messages)
    assert plain[0] == tok.encode("Paris is")
    for _, tokens, text in (chat, plain):
        assert len(tokens) == 4 and text == tok.decode(tokens)
    cached = sorted(p.name for p in (tmp_path / ".gguf-sidecar").glob("*/*"))
    assert cached == ["config", "tokenizer"]  # built and saved by the torch-less process


def test_paths_that_need_torch_name_the_extra(smollm2_gguf, tmp_path):
    """The torch fallback (imported, asked for, or taken by ``--model-impl auto``), a
    GGUF architecture jaxengine does not build, and the roofline fail with one
    ImportError naming the extra when torch is absent."""
    phi3 = write_gguf(tmp_path / "phi3.gguf", "phi3")
    gpt2 = tmp_path / "gpt2"  # an architecture with no JAX port: `auto` takes the fallback
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps(GPT2))
    code = f"""
import json, sys
from pathlib import Path
errors = {{}}
def attempt(what, fn):
    try:
        fn()
    except ImportError as e:
        errors[what] = str(e)
def fallback():
    import torch_fallback
def llm():
    from jaxengine import LLM
    LLM({str(smollm2_gguf)!r}, model_impl="transformers", max_model_len=64)
def auto():
    from jaxengine import LLM
    LLM({str(gpt2)!r}, skip_tokenizer_init=True, max_model_len=64)
def gguf_config():
    from jaxengine.loader.hf_config import load_hf_config
    load_hf_config({str(phi3)!r})
def roofline():
    from jaxengine.benchmarks.common import ModelFiles
    from jaxengine.benchmarks.roofline import model_weight_bytes
    model_weight_bytes(ModelFiles("m", Path({str(phi3)!r}), Path({str(tmp_path)!r})))
for what, fn in [("fallback", fallback), ("llm", llm), ("auto", auto),
                 ("gguf", gguf_config), ("roofline", roofline)]:
    attempt(what, fn)
print(json.dumps([errors, {TORCH_LOADED}]))
"""
    result = run_without_torch(code, env={"JAXENGINE_GGUF_SIDECAR": "0"})
    errors, torch_modules = last_json_line(result)
    assert torch_modules == []
    assert errors.pop("auto").endswith(
        f"the torch fallback (--model-impl transformers) that runs it {NEEDS_TORCH}"
    )
    assert errors == {
        "fallback": f"the torch fallback (--model-impl transformers) {NEEDS_TORCH}",
        "llm": f"--model-impl transformers (the torch fallback) {NEEDS_TORCH}",
        "gguf": f"the config of a GGUF file of architecture 'phi3' {NEEDS_TORCH}",
        "roofline": f"the latency benchmark's roofline (--no-roofline skips it) {NEEDS_TORCH}",
    }
