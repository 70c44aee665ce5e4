"""jaxengine as Tunix's rollout engine: `JaxEngineRollout`, a ``BaseRollout``.

Tunix (``google-tunix``) trains with RL through an ``RLCluster`` whose rollout engine
is a ``tunix.rl.rollout.base_rollout.BaseRollout`` subclass, named in its
``ClusterConfig``::

    ClusterConfig(rollout_engine=functools.partial(JaxEngineRollout, engine_kwargs={...}),
                  rollout_config=RolloutConfig(...), ...)

(the class itself works too). The cluster builds it with the trainer's model
(``rollout_actor``), its tokenizer, the rollout mesh and the ``RolloutConfig``. An
`LLM` is started for the same model: from ``model`` (a Hugging Face checkpoint's
folder or id) or, without one, from a ``config.json`` written from the Tunix
model's config (`tunix_params.hf_config`) with no tokenizer; its weights are dummy
until `update_params` writes the trainer's, which the constructor does at once.

- `generate`: prompts tokenized as Tunix's samplers do (BOS, then the text), one
  request each; tokens keep their stop token (as Tunix's vLLM rollout: the trainer
  scores what was sampled, EOS included), texts leave it out (as Tunix's own
  sampler); per-token logprobs with ``return_logprobs`` (``logprobs_mode``
  ``rollout_vllm_logprobs_mode``, processed by default: after temperature, as
  Tunix's sampler);
- `get_per_token_logps`: the completion tokens' logprobs under the engine's
  weights, at temperature 1 (prompt logprobs of prompt + completion, pads left out);
- `update_params`: Tunix's parameters as Hugging Face tensors (`tunix_params`) into
  `LLM.update_weights`, on device: the jax arrays are reshaped and transposed where
  they are and resharded onto the engine's mesh, no host round trip (Tunix calls it
  under a host-transfer guard on CPU);
- `model`: None: the weights live in the engine (as Tunix's vLLM and SGLang-JAX
  rollouts), so the cluster syncs them after each training step.

The engine's arguments: ``max_model_len`` = ``kv_cache_size``, and the vLLM knobs of
``RolloutConfig`` that jaxengine shares (max_num_seqs, max_num_batched_tokens,
hbm utilization, logprobs mode, tensor and data parallel sizes when positive), then
``engine_kwargs`` over them. The engine places itself as `LLM` does (the first
devices), whatever ``mesh`` says. LoRA parameters are refused: merge them first.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.generate.tokenizer_adapter import TokenizerAdapter
from tunix.rl.rollout import base_rollout

from jaxengine.entrypoints.llm import LLM
from jaxengine.integrations.tunix_params import Family, family_of, hf_config, hf_weights
from jaxengine.sampling_params import SamplingParams


def flat_params(params: Any) -> list[tuple[str, Any]]:
    """``(dotted path, array)`` of an NNX state (or a nested dict of arrays)."""
    pairs = []
    for path, leaf in nnx.to_flat_state(nnx.State(params) if isinstance(params, dict) else params):
        value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
        pairs.append((".".join(str(p) for p in path), value))
    return pairs


def left_padded(prompts: Sequence[Sequence[int]], length: int, pad_id: int) -> np.ndarray:
    """``[B, L]`` prompts padded on the left with ``pad_id``; ``L`` is ``length``, or
    the next power of two at least the longest prompt when that is longer (Tunix's
    samplers' rule)."""
    longest = max(len(p) for p in prompts)
    if length < longest:
        length = 1 << max(longest - 1, 0).bit_length()
    out = np.full((len(prompts), length), pad_id, dtype=np.int32)
    for row, prompt in enumerate(prompts):
        out[row, length - len(prompt) :] = prompt
    return out


def seed_of(seed: Any) -> int | None:
    """An int seed from Tunix's ``RolloutConfig.seed`` (None, an int, or a PRNG key)."""
    if seed is None or isinstance(seed, int):
        return seed
    if jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
        seed = jax.random.key_data(seed)
    return int(np.asarray(seed).ravel()[-1])


def engine_args(config: base_rollout.RolloutConfig, overrides: dict[str, Any]) -> dict[str, Any]:
    """The `LLM` arguments of a rollout config, ``overrides`` over them."""
    args: dict[str, Any] = dict(
        load_format="dummy",  # update_params writes the trainer's weights at once
        skip_tokenizer_init=True,  # prompts come tokenized, texts are decoded here
        max_model_len=config.kv_cache_size,
        logprobs_mode=config.rollout_vllm_logprobs_mode,
        gpu_memory_utilization=config.rollout_vllm_hbm_utilization,
    )
    optional = {
        "max_num_seqs": config.rollout_vllm_max_num_seqs,
        "max_num_batched_tokens": config.rollout_vllm_max_num_batched_tokens,
        "tensor_parallel_size": config.tensor_parallel_size,
        "data_parallel_size": config.data_parallel_size,
    }
    args.update({k: v for k, v in optional.items() if v is not None and v > 0})
    return {**args, **overrides}


def sampling_params(
    config: base_rollout.RolloutConfig, count: int, stops: list[int], extra: dict[str, Any]
) -> list[SamplingParams]:
    """One `SamplingParams` per request, stopping at ``stops``; ``extra``: more fields.
    A seeded config gives request ``i`` the seed ``seed + i``: one seed for all would
    sample a GRPO group's copies of a prompt alike."""
    seed = seed_of(config.seed)
    fields = dict(
        temperature=config.temperature,
        top_p=1.0 if config.top_p is None else config.top_p,
        top_k=config.top_k or 0,
        max_tokens=config.max_tokens_to_generate,
        logprobs=0 if config.return_logprobs else None,
        stop_token_ids=stops,
        detokenize=False,
        **{**config.rollout_vllm_sampling_kwargs, **extra},
    )
    return [SamplingParams(**fields, seed=None if seed is None else seed + i) for i in range(count)]


class JaxEngineRollout(base_rollout.BaseRollout):
    """Tunix's rollout engine interface over a jaxengine `LLM` (module docstring)."""

    def __init__(
        self,
        rollout_actor: nnx.Module,
        tokenizer: Any,
        mesh: jax.sharding.Mesh | None,
        rollout_config: base_rollout.RolloutConfig,
        *,
        model: str | None = None,
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """``model``: the checkpoint the engine's config comes from (default
        ``rollout_config.rollout_vllm_model_version``; none: written from the Tunix
        model's config); ``engine_kwargs``: `LLM` arguments over `engine_args`."""
        self.family: Family = family_of(rollout_actor)
        self.tokenizer = (
            tokenizer if isinstance(tokenizer, TokenizerAdapter) else TokenizerAdapter(tokenizer)
        )
        self.rollout_mesh = mesh  # the cluster's; the engine places itself (see module)
        self._config_dir: tempfile.TemporaryDirectory | None = None
        args = engine_args(rollout_config, engine_kwargs or {})
        model = model or rollout_config.rollout_vllm_model_version or None
        if model is None:
            model = self._write_config(rollout_actor, args["max_model_len"])
        self.llm = LLM(model, **args)
        self.update_params(nnx.state(rollout_actor, nnx.Param))

    def _write_config(self, actor: nnx.Module, max_model_len: int) -> str:
        """A folder with the ``config.json`` of the Tunix model (kept until shutdown)."""
        import transformers

        dtype = jax.tree_util.tree_leaves(nnx.state(actor, nnx.Param))[0].dtype
        fields = hf_config(
            self.family,
            actor.config,
            max_position_embeddings=max_model_len,
            bos_token_id=self.tokenizer.bos_id(),
            eos_token_id=self.tokenizer.eos_id(),
            pad_token_id=self.tokenizer.pad_id(),
            dtype=jnp.dtype(dtype).name,
        )
        self._config_dir = tempfile.TemporaryDirectory(prefix="jaxengine-tunix-")
        hf = transformers.AutoConfig.for_model(**fields)
        hf.save_pretrained(self._config_dir.name)
        return self._config_dir.name

    # -- BaseRollout ---------------------------------------------------------------

    def generate(
        self, prompts: list[str], rollout_config: base_rollout.RolloutConfig, **kwargs: Any
    ) -> base_rollout.RolloutOutput:
        """One sample per prompt; ``kwargs``: more `SamplingParams` fields."""
        ids = [self.tokenize(p) for p in prompts]
        stops = list(rollout_config.eos_tokens or [self.eos_id()])
        params = sampling_params(rollout_config, len(ids), stops, kwargs)
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        tokens, texts, logprobs = [], [], []
        for out in outputs:
            sample = out.outputs[0]
            tokens.append(np.asarray(sample.token_ids, dtype=np.int32))
            text_ids = list(sample.token_ids)
            if text_ids and text_ids[-1] in stops:  # the stop token: out of the text
                text_ids.pop()
            texts.append(self.tokenizer.decode(text_ids))
            if sample.logprobs is not None:
                logprobs.append(
                    [lp[t].logprob for t, lp in zip(sample.token_ids, sample.logprobs, strict=True)]
                )
        return base_rollout.RolloutOutput(
            text=texts,
            logits=None,
            tokens=tokens,
            left_padded_prompt_tokens=left_padded(
                ids, rollout_config.max_prompt_length, self.pad_id()
            ),
            logprobs=logprobs if rollout_config.return_logprobs else None,
        )

    def get_per_token_logps(
        self, prompt_tokens: jax.Array, completion_tokens: jax.Array
    ) -> jax.Array:
        """``[B, C]`` logprobs of each completion token given the tokens before it (pads
        left out, as Tunix's ``compute_per_token_logps``); 0 where the completion is a
        pad."""
        prompts, completions = np.asarray(prompt_tokens), np.asarray(completion_tokens)
        pad = self.pad_id()
        sequences = [
            [int(t) for t in np.concatenate([p[p != pad], c[c != pad]])]
            for p, c in zip(prompts, completions, strict=True)
        ]
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate(
            [{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False
        )
        out = np.zeros(completions.shape, dtype=np.float32)
        for row, (seq, result) in enumerate(zip(sequences, outputs, strict=True)):
            where = np.flatnonzero(completions[row] != pad)
            first = len(seq) - len(where)  # the completion's first position in seq
            for k, col in enumerate(where):
                entry = result.prompt_logprobs[first + k]
                out[row, col] = entry[seq[first + k]].logprob
        return jnp.asarray(out)

    def update_params(self, params: Any, filter_types: tuple[Any, ...] | None = None) -> None:
        """Writes Tunix parameters (an NNX state: every parameter, or some) into the
        engine, all or nothing; raises `ValueError` naming one with no Hugging Face
        name."""
        if filter_types is not None and any(
            isinstance(t, type) and issubclass(t, nnx.LoRAParam) for t in filter_types
        ):
            raise NotImplementedError(
                "JaxEngineRollout takes full weights, not LoRA parameters: merge the "
                "adapters into the base model's weights first"
            )
        self.llm.update_weights(list(hf_weights(self.family, flat_params(params))))

    def pad_id(self) -> int:
        return self.tokenizer.pad_id()

    def eos_id(self) -> int:
        return self.tokenizer.eos_id()

    def model(self) -> None:
        """None: the weights live in the engine (module docstring)."""
        return None

    # -- helpers -------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        """BOS (when the tokenizer has one), then the text's ids; a repeated leading
        BOS kept once (Tunix's samplers' rule)."""
        bos = self.tokenizer.bos_id()
        ids = ([bos] if bos else []) + list(self.tokenizer.encode(text))
        return [int(t) for t in self.tokenizer.dedup_bos_ids(ids)]

    def shutdown(self) -> None:
        """Releases the engine's device memory and the written config."""
        self.llm.shutdown()
        if self._config_dir is not None:
            self._config_dir.cleanup()
            self._config_dir = None
