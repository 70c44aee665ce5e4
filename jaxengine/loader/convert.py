"""``--convert classify``: a causal LM checkpoint loaded as a sequence classifier.

`as_classifier` renames the config's ``*ForCausalLM`` architecture to
``*ForSequenceClassification`` (`jaxengine.models` builds the family's layers under
a ``score`` head, read at the last token). The head comes from the checkpoint's own
``score.weight``, or, as vLLM does for LLM rerankers (Qwen3-Reranker, mxbai-rerank
v2), from rows of the LM head named in the config (``--hf-overrides``):

- ``classifier_from_token``: the tokens whose LM-head rows make the head;
- ``method`` ``"no_post_processing"``: one label per token, its row as is;
  ``"from_2_way_softmax"`` (two tokens, false then true; also implied by
  ``is_original_qwen3_reranker``): one label, the true row minus the false one, so
  the label's sigmoid is the softmax of the two tokens' logits.

`classifier_tensors` then turns the checkpoint's LM head into ``score.weight``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from jaxengine.loader.errors import CheckpointError

METHODS = ("from_2_way_softmax", "no_post_processing")
GENERATE_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")


def head_tokens(hf_config: Any) -> tuple[list[str], str] | None:
    """``(classifier_from_token, method)`` when the config asks for a head built from
    the LM head, None when the checkpoint must carry its ``score.weight``."""
    tokens = getattr(hf_config, "classifier_from_token", None)
    method = getattr(hf_config, "method", None)
    if getattr(hf_config, "is_original_qwen3_reranker", False):
        method = method or "from_2_way_softmax"
    if tokens is None and method is None:
        return None
    if not tokens or method not in METHODS:
        raise ValueError(
            "--convert classify: classifier_from_token (a list of tokens) and method "
            f"(one of {list(METHODS)}) go together; got {tokens!r} and {method!r}"
        )
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ValueError(
            f"--convert classify: from_2_way_softmax takes two tokens (false, true), got {tokens!r}"
        )
    return list(tokens), method


def as_classifier(hf_config: Any) -> Any:
    """``hf_config`` as a sequence classifier's (its architectures renamed; with a
    head from tokens, ``num_labels`` set from them). Changes ``hf_config`` in place."""
    from jaxengine.models import architecture_of

    # a config without architectures (a GGUF file's) is named by its model_type
    archs = list(getattr(hf_config, "architectures", None) or [architecture_of(hf_config)])
    renamed = []
    for name in archs:
        for suffix in GENERATE_SUFFIXES:
            if name.endswith(suffix):
                name = name.removesuffix(suffix) + "ForSequenceClassification"
        renamed.append(name)
    hf_config.architectures = renamed
    spec = head_tokens(hf_config)
    if spec is not None:
        tokens, method = spec
        hf_config.num_labels = 1 if method == "from_2_way_softmax" else len(tokens)
    return hf_config


def classifier_tensors(
    tensors: Iterable[tuple[str, np.ndarray]],
    hf_config: Any,
    token_ids: Callable[[list[str]], list[int]],
    where: str,
) -> Iterator[tuple[str, np.ndarray]]:
    """The checkpoint's tensors without its LM head, with ``score.weight`` built from
    it when `head_tokens` says so (``lm_head.weight``, or the tied embedding); without that,
    a checkpoint lacking ``score.weight`` is a `CheckpointError` naming the fix.
    ``token_ids`` maps the config's tokens to ids (the model's tokenizer)."""
    spec = head_tokens(hf_config)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    source = "model.embed_tokens.weight" if tied else "lm_head.weight"
    has_score = False
    for name, array in tensors:
        has_score = has_score or name == "score.weight"
        if spec is not None and name == source:
            yield "score.weight", _head_rows(np.asarray(array), spec, token_ids)
        # a classifier has no LM head; a head from tokens replaces a stored one
        if name != "lm_head.weight" and (name != "score.weight" or spec is None):
            yield name, array
    if spec is None and not has_score:
        raise CheckpointError(
            f"{where}: --convert classify needs a classification head: the checkpoint has "
            "no score.weight; to build one from the LM head, give --hf-overrides "
            '\'{"classifier_from_token": [...], "method": "no_post_processing"}\' '
            '(or "from_2_way_softmax" with two tokens, false then true)'
        )


def _head_rows(weight: np.ndarray, spec: tuple[list[str], str], token_ids) -> np.ndarray:
    tokens, method = spec
    ids = token_ids(tokens)
    for token, i in zip(tokens, ids, strict=True):
        if i is None or not 0 <= i < weight.shape[0]:
            raise ValueError(f"classifier_from_token: {token!r} is not a token of the vocabulary")
    rows = weight[ids].astype(np.float32)
    if method == "from_2_way_softmax":
        return rows[1:2] - rows[0:1]
    return rows
