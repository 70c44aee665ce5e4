"""The demo models' GGUF tensors equal, one by one, what transformers loads from them.

This is the acceptance test of `iter_gguf`: SmolLM2 (llama: Q4_1 / Q8_0, permuted
Q and K) and Gemma 3 (K-quants, Q5_0, norms stored as 1 + w). Slow: transformers
parses the whole file with `gguf.GGUFReader` (some 10 s for Gemma's vocabulary), and
dequantizes it all before we do the same.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxengine.loader.gguf_io import iter_gguf
from jaxengine.loader.hf_config import load_hf_config
from jaxengine.loader.sources import resolve_model

pytestmark = pytest.mark.slow


def _transformers_state_dict(gguf_path) -> dict[str, np.ndarray]:
    import torch
    from transformers import AutoModelForCausalLM

    source = resolve_model(gguf_path)
    config = load_hf_config(source)
    model = AutoModelForCausalLM.from_pretrained(
        source.path, gguf_file=source.gguf_file.name, config=config, dtype=torch.float32
    )
    return {name: t.numpy() for name, t in model.state_dict().items()}


@pytest.mark.parametrize("fixture", ["smollm2_gguf", "gemma3_gguf"])
def test_tensors_equal_transformers(fixture, request):
    path = request.getfixturevalue(fixture)
    reference = _transformers_state_dict(path)
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
