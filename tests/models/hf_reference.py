"""transformers as the numerical reference: loading GGUF files and greedy generation."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers


def reference_threads() -> None:
    """Two torch threads for a reference, one on an xdist worker: two workers share
    the two cores, and two OpenMP threads on a busy core spin at each barrier (the
    golden test's SmolLM2 references took 518 s on a worker instead of about 20)."""
    torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


class PlainArrayGGUFReader(gguf.GGUFReader):
    """``gguf.GGUFReader`` reading through a plain ndarray view of its memory map.

    The reader parses a file's metadata element by element (Gemma 3's 262k-token
    vocabulary: about a million small reads), and every read of an ``np.memmap`` runs
    numpy's Python-level ``memmap.__getitem__`` and ``__array_finalize__``: 20 s for
    Gemma 3's header against 6 s through the plain view of the same mapped bytes (a
    script; the same fields and tensors). The tests put this class in
    ``gguf.GGUFReader`` (`tests/conftest.py`), where transformers' GGUF loader finds it;
    the engine reads GGUF files with its own parser (`jaxengine.loader.gguf_io`)."""

    @property
    def data(self):
        return self._plain

    @data.setter
    def data(self, mapped) -> None:
        self._plain = mapped.view(np.ndarray)  # the mapping stays alive as its base


def hf_from_gguf(path: Path, cache_dir: Path):
    """transformers' float32 model of a .gguf file (its own dequantization).

    ``cache_dir``: the run's `reference_cache_dir`, shared by the xdist workers. The
    first caller saves the dequantized model there as safetensors and every later
    one loads that: transformers reads a GGUF's metadata field by field
    through numpy (Gemma 3's 262k-token vocabulary took 41 s, SmolLM2's 18 s; the
    saved copy loads in under a second), and each worker would do it again."""
    from filelock import FileLock

    reference_threads()
    folder = Path(cache_dir) / f"{path.stem}-{path.stat().st_size}"
    with FileLock(f"{folder}.lock"):
        if not (folder / "config.json").exists():
            dequantized = transformers.AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32
            )
            _save(dequantized, folder)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _save(model, folder: Path) -> None:
    """The model's float32 tensors and its config, without the GGUF quantization entry
    (transformers refuses to save a model loaded from GGUF)."""
    from safetensors.torch import save_model

    folder.mkdir(parents=True)
    save_model(model, str(folder / "model.safetensors"))  # tied tensors saved once
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(folder)  # written last: its presence marks a whole copy


def hf_greedy(model, prompt_ids, new_tokens):
    """transformers' greedy continuation, never stopping early (EOS included)."""
    return hf_greedy_batch(model, [prompt_ids], new_tokens)[0]


def hf_greedy_batch(model, prompts, new_tokens):
    """`hf_greedy` of every prompt, as one left-padded batch (masked padding; the
    positions follow the mask). A decode step reads the weights once for the whole
    batch instead of once per prompt: SmolLM2's 16 golden prompts took 4.3 s batched
    against 26 s one by one, with the same tokens."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.set_flush_denormal(True)  # tests/conftest.py: _flush_denormals
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[:, width:].tolist()


def hf_beam_search(model, prompt_ids, width, new_tokens, length_penalty, early_stopping, eos):
    """transformers' beam search: ``width`` sequences, best first, each cut after its
    first ``eos`` (kept), and their scores (``sequences_scores``)."""
    torch.set_flush_denormal(True)  # tests/conftest.py: _flush_denormals
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            num_beams=width,
            num_return_sequences=width,
            max_new_tokens=new_tokens,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
            return_dict_in_generate=True,
            output_scores=True,
        )
    beams = []
    for row in out.sequences[:, len(prompt_ids) :].tolist():
        beams.append(row[: row.index(eos) + 1] if eos in row else row)
    return beams, out.sequences_scores.tolist()


def hf_greedy_images(model, processor, text: str, images: list, new_tokens: int, **kwargs):
    """transformers' greedy tokens for a prompt with ``images`` (a vision-language model
    and its processor; ``kwargs`` to the processor) and each step's log-softmax row:
    ``(tokens, [V] float32 tensors)``."""
    inputs = processor(
        text=[text], images=[images] if images else None, return_tensors="pt", **kwargs
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)  # fmt: skip
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    return tokens, [torch.log_softmax(s[0].float(), -1) for s in out.scores]
