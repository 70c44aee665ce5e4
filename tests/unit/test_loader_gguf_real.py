"""The demo models' GGUF tensors equal, one by one, what transformers loads from them.

This is the acceptance test of `iter_gguf`: SmolLM2 (llama: Q4_1 / Q8_0, permuted
Q and K) and Gemma 3 (K-quants, Q5_0, norms stored as 1 + w). Slow: transformers
parses the whole file with `gguf.GGUFReader` (some 40 s for Gemma's vocabulary on one
thread), and dequantizes it all before we do the same; the run keeps its copy for the
golden tests (`hf_reference.hf_from_gguf`).
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxengine.loader.gguf_io import iter_gguf
from jaxengine.loader.hf_config import load_hf_config

pytestmark = pytest.mark.slow


def _transformers_state_dict(gguf_path, cache_dir) -> dict[str, np.ndarray]:
    from tests.models.hf_reference import hf_from_gguf

    model = hf_from_gguf(gguf_path, cache_dir)  # the run's copy, shared with the golden tests
    return {name: t.numpy() for name, t in model.state_dict().items()}


@pytest.mark.parametrize("fixture", ["smollm2_gguf", "gemma3_gguf"])
def test_tensors_equal_transformers(fixture, request, reference_cache_dir):
    path = request.getfixturevalue(fixture)
    reference = _transformers_state_dict(path, reference_cache_dir)
    seen = set()
    for name, ours in iter_gguf(path):
        assert name in reference, f"{name} is not a transformers parameter"
        assert name not in seen, f"{name} yielded twice"
        seen.add(name)
        assert ours.dtype == np.float32 and ours.shape == reference[name].shape, name
        np.testing.assert_array_equal(ours, reference[name], err_msg=name)
    # Both files tie the embeddings: transformers shows lm_head.weight, we do not.
    assert set(reference) - seen == {"lm_head.weight"}


def test_smollm2_config_and_generation_config(smollm2_gguf):
    from transformers import AutoConfig

    from jaxengine.loader.hf_config import load_generation_config

    load_hf_config(smollm2_gguf)  # fills the sidecar cache, if not yet there
    ours = load_hf_config(smollm2_gguf).to_dict()  # read back from the sidecar
    direct = AutoConfig.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name).to_dict()
    for key in ("_name_or_path", "_model_name_or_path", "transformers_version"):
        ours.pop(key, None), direct.pop(key, None)
    assert ours == direct
    assert ours["num_hidden_layers"] == 30 and ours["tie_word_embeddings"]
    assert load_generation_config(smollm2_gguf) == {
        "eos_token_id": 2,
        "bos_token_id": 1,
        "pad_token_id": 2,
    }
