"""jaxengine as Tunix's rollout engine (`jaxengine.integrations.tunix`).

One tiny Tunix Llama3 (2 layers, hidden 64, SmolLM2's tokenizer, random weights),
sharded over two devices, and one ``RLCluster`` whose rollout engine is
`JaxEngineRollout` (one engine for the module, on one device). References are Tunix's
own: its sampler and its ``compute_per_token_logps`` on the same weights.

- after `update_params`, greedy rollouts are Tunix's sampler's tokens and texts, and
  their logprobs are its logprobs within 1e-4;
- `get_per_token_logps` of sampled completions (left-padded prompts, right-padded
  completions) is Tunix's within 1e-4 wherever the completion is not a pad;
- one GRPO step of Tunix's learner runs through the engine: the rollouts are the
  engine's, the actor's weights change, and the engine follows them (Tunix's
  ``sync_weights``, under its host-transfer guard: the update stays on device).

The rollout config's translation (engine arguments, per-request sampling parameters,
prompt padding) is checked on its own, and the other families' names and configs
(Qwen2, Qwen3, Qwen3 MoE) without an engine: their Hugging Face tensors and config,
saved and loaded by transformers, give Tunix's logits.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh
from tunix.generate import sampler as tunix_sampler
from tunix.models.llama3 import model as llama3
from tunix.models.qwen2 import model as qwen2
from tunix.models.qwen3 import model as qwen3
from tunix.rl import common, rl_cluster
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout

from jaxengine.integrations.tunix import (
    JaxEngineRollout,
    engine_args,
    flat_params,
    left_padded,
    sampling_params,
)
from jaxengine.integrations.tunix_params import family_of, hf_config, hf_weights
from tests.engine.conftest import small_llm_kwargs

PROMPTS = ["Hello there", "The capital of France is", "1, 2, 3,"]
PROMPT_LEN, NEW_TOKENS = 8, 8
GREEDY = base_rollout.RolloutConfig(
    temperature=0.0,
    max_tokens_to_generate=NEW_TOKENS,
    max_prompt_length=PROMPT_LEN,
    return_logprobs=True,
)


def random_model(build, seed: int) -> nnx.Module:
    """``build()``'s model with `randomize`'s weights (built abstract: Tunix's own
    initializers would compile for every shape)."""
    model = nnx.eval_shape(build)
    randomize(model, seed)
    return model


def randomize(model: nnx.Module, seed: int) -> None:
    """New random weights in place, each leaf on its own sharding (an abstract one on
    the default device): norms (and biases) near 1, the rest N(0, 0.2^2). Drawn with
    numpy: nothing to compile."""
    rng = np.random.default_rng(seed)
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    new = [
        jax.device_put(
            (1.0 if x.ndim == 1 else 0.0)
            + (0.1 if x.ndim == 1 else 0.2) * rng.standard_normal(x.shape, np.float32),
            getattr(x, "sharding", None),
        )
        for x in leaves
    ]
    nnx.update(model, jax.tree_util.tree_unflatten(treedef, new))


def tiny_llama3(vocab_size: int) -> llama3.Llama3:
    config = llama3.ModelConfig(
        num_layers=2, vocab_size=vocab_size, embed_dim=64, hidden_dim=128, num_heads=4,
        head_dim=16, num_kv_heads=2, rope_theta=1_000_000, norm_eps=1e-5,
        weight_tying=False,
    )  # fmt: skip
    return random_model(lambda: llama3.Llama3(config, rngs=nnx.Rngs(0)), seed=0)


def tunix_logits(model: nnx.Module, tokens: np.ndarray) -> np.ndarray:
    """Tunix's forward pass over ``[1, T]`` tokens, causal, compiled whole."""
    graphdef, state = nnx.split(model)
    length = tokens.shape[1]
    causal = jnp.tril(jnp.ones((1, length, length), dtype=bool))
    forward = jax.jit(
        lambda s, t: nnx.merge(graphdef, s)(t, jnp.arange(length)[None], None, causal)[0]
    )
    return np.asarray(forward(state, jnp.asarray(tokens)))


@contextlib.contextmanager
def no_host_transfers():
    """Any transfer between host and device raises (Tunix's guard in sync_weights)."""
    with (
        jax.transfer_guard_host_to_device("disallow_explicit"),
        jax.transfer_guard_device_to_host("disallow_explicit"),
    ):
        yield


def tunix_logps(model: nnx.Module, prompts, completions, pad_id: int, eos_id: int):
    graphdef, state = nnx.split(model)
    return np.asarray(
        common.compute_per_token_logps(
            graphdef, state, jnp.asarray(prompts), jnp.asarray(completions), pad_id, eos_id
        )
    )


def right_padded(tokens: list[np.ndarray], length: int, pad_id: int) -> np.ndarray:
    out = np.full((len(tokens), length), pad_id, dtype=np.int32)
    for row, t in enumerate(tokens):
        out[row, : len(t)] = t
    return out


def engine_kwargs(xla_cache_dir: str) -> dict:
    """The engine tests' small engine, compiling on first use only what is run
    (``enforce_eager``: no warm-up of every bucket)."""
    return {**small_llm_kwargs(xla_cache_dir), "enforce_eager": True}


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:2]).reshape(2, 1), ("fsdp", "tp"))


@pytest.fixture(scope="module")
def cluster(smollm2_tokenizer, mesh, xla_cache_dir):
    """An RLCluster over the tiny Llama3 (actor, sharded over ``mesh``) with the
    engine as its rollout engine; GRPO's batch sizes; one training step."""
    actor = tiny_llama3(len(smollm2_tokenizer))
    config = rl_cluster.ClusterConfig(
        role_to_mesh={rl_cluster.Role.ACTOR: mesh, rl_cluster.Role.ROLLOUT: mesh},
        rollout_engine=functools.partial(
            JaxEngineRollout, engine_kwargs=engine_kwargs(xla_cache_dir)
        ),
        training_config=rl_cluster.RLTrainingConfig(
            actor_optimizer=optax.sgd(0.1), eval_every_n_steps=10, max_steps=1
        ),
        rollout_config=base_rollout.RolloutConfig(
            temperature=1.0,
            seed=0,
            max_tokens_to_generate=NEW_TOKENS,
            max_prompt_length=PROMPT_LEN,
            kv_cache_size=64,
        ),
    )
    cluster = rl_cluster.RLCluster(actor=actor, tokenizer=smollm2_tokenizer, cluster_config=config)
    yield cluster
    cluster.rollout.shutdown()


@pytest.fixture(scope="module")
def actor(cluster):
    return cluster.actor_trainer.model


def assert_logps_match(rollout, actor, sampled) -> tuple[np.ndarray, np.ndarray]:
    """The engine's per-token logprobs of ``sampled``'s completions equal Tunix's own
    (`tunix_logps`) within 1e-4 on the unpadded positions; returns (the engine's
    logprobs, that mask)."""
    pad, eos = rollout.pad_id(), rollout.eos_id()
    prompts = sampled.left_padded_prompt_tokens
    completions = right_padded(sampled.tokens, NEW_TOKENS, pad)
    ours = np.asarray(rollout.get_per_token_logps(jnp.asarray(prompts), jnp.asarray(completions)))
    theirs = tunix_logps(actor, prompts, completions, pad, eos)
    mask = completions != pad
    np.testing.assert_allclose(ours[mask], theirs[mask], atol=1e-4)
    return ours, mask


def test_greedy_rollouts_after_update_params_equal_tunix_sampler(cluster, actor):
    rollout, tokenizer = cluster.rollout, cluster.tokenizer
    before = rollout.generate(PROMPTS, GREEDY)
    randomize(actor, seed=1)
    with no_host_transfers():  # the actor is sharded over two devices, the engine one
        rollout.update_params(nnx.state(actor, nnx.Param), (nnx.Param,))
    ours = rollout.generate(PROMPTS, GREEDY)
    cache = tunix_sampler.CacheConfig(cache_size=32, num_layers=2, num_kv_heads=2, head_dim=16)
    theirs = tunix_sampler.Sampler(actor, tokenizer, cache)(
        PROMPTS, max_generation_steps=NEW_TOKENS, max_prompt_length=PROMPT_LEN,
        temperature=0.0, return_logprobs=True,
    )  # fmt: skip
    eos = rollout.eos_id()
    # ours keep the stop token (the trainer scores it); Tunix's sampler drops it
    kept = [t[:-1] if len(t) and t[-1] == eos else t for t in ours.tokens]
    assert [t.tolist() for t in kept] == [t.tolist() for t in theirs.tokens]
    assert [t.tolist() for t in before.tokens] != [t.tolist() for t in ours.tokens]
    assert ours.text == theirs.text
    np.testing.assert_array_equal(ours.left_padded_prompt_tokens, theirs.padded_prompt_tokens)
    for mine, ref in zip(ours.logprobs, theirs.logprobs, strict=True):
        np.testing.assert_allclose(mine[: len(ref)], ref, atol=1e-4)


def test_per_token_logps_equal_tunix_within_1e_4(cluster, actor):
    rollout = cluster.rollout
    rollout.update_params(nnx.state(actor, nnx.Param))
    config = base_rollout.RolloutConfig(
        temperature=1.0, seed=7, max_tokens_to_generate=NEW_TOKENS,
        max_prompt_length=PROMPT_LEN, return_logprobs=True,
    )  # fmt: skip
    sampled = rollout.generate(PROMPTS, config)
    ours, mask = assert_logps_match(rollout, actor, sampled)
    assert mask.sum() >= len(PROMPTS) * 2
    assert not ours[~mask].any()
    # the sampler's logprobs (temperature 1: processed = raw) are the same numbers
    for row, lps in enumerate(sampled.logprobs):
        np.testing.assert_allclose(lps, ours[row, : len(lps)], atol=1e-4)


def test_one_grpo_step_trains_the_actor_and_syncs_the_engine(cluster, actor):
    seen: list[str] = []

    def reward(prompts, completions, **kwargs):
        seen.extend(completions)
        return [float(len(c)) for c in completions]

    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster,
        algo_config=grpo_learner.GRPOConfig(num_generations=2, num_iterations=1, beta=0.0),
        reward_fns=reward,
    )
    assert learner.should_sync_weights  # the engine holds its own copy of the weights
    before = jax.tree_util.tree_map(jnp.copy, nnx.state(actor, nnx.Param))
    learner.train([{"prompts": np.array(PROMPTS[:2])}])
    assert len(seen) == 4  # two prompts, two samples each, from the engine
    assert cluster.actor_trainer.train_steps == 1 and cluster.global_steps == 1
    changed = jax.tree_util.tree_map(
        lambda a, b: bool(jnp.any(a != b)), before, nnx.state(actor, nnx.Param)
    )
    assert any(jax.tree_util.tree_leaves(changed))
    # the engine scores with the trained weights (synced after the step)
    rollout = cluster.rollout
    sampled = rollout.generate(PROMPTS, GREEDY)
    assert_logps_match(rollout, actor, sampled)


SMALL = dict(
    num_layers=2, vocab_size=128, embed_dim=32, hidden_dim=64, num_heads=4, head_dim=8,
    num_kv_heads=2, rope_theta=1_000_000, norm_eps=1e-6,
)  # fmt: skip
FAMILIES = {
    "qwen2": lambda: qwen2.Qwen2(
        qwen2.ModelConfig(**SMALL, use_tied_embedding=False), rngs=nnx.Rngs(0)
    ),
    "qwen3": lambda: qwen3.Qwen3(
        qwen3.ModelConfig(**SMALL, use_tied_embedding=True), rngs=nnx.Rngs(0)
    ),
    "qwen3_moe": lambda: qwen3.Qwen3(
        qwen3.ModelConfig(**SMALL, use_tied_embedding=False, num_experts=4, num_experts_per_tok=2),
        rngs=nnx.Rngs(0),
    ),
}
"""Tunix model builders (tiny: 2 layers, hidden 32, 128 tokens)."""


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_tensors_and_config_give_tunix_logits_in_transformers(family, tmp_path):
    import safetensors.numpy
    import torch
    import transformers

    model = random_model(FAMILIES[family], seed=2)
    mapping = family_of(model)
    fields = hf_config(mapping, model.config, max_position_embeddings=64, dtype="float32")
    assert fields["model_type"] == family
    transformers.AutoConfig.for_model(**fields).save_pretrained(tmp_path)
    tensors = hf_weights(mapping, flat_params(nnx.state(model, nnx.Param)))
    safetensors.numpy.save_file(
        {k: np.asarray(v) for k, v in tensors}, tmp_path / "model.safetensors"
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = np.arange(3, 15)[None]  # [1, T]
    with torch.no_grad():
        ours = hf(torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_allclose(ours, tunix_logits(model, tokens), atol=1e-4)


def test_rollout_config_becomes_engine_and_request_arguments():
    config = base_rollout.RolloutConfig(
        temperature=0.7, top_p=None, top_k=None, seed=jax.random.PRNGKey(5),
        max_tokens_to_generate=16, return_logprobs=True, kv_cache_size=256,
        rollout_vllm_max_num_seqs=4, rollout_vllm_sampling_kwargs={"min_p": 0.1},
    )  # fmt: skip
    args = engine_args(config, {"max_model_len": 128, "enforce_eager": True})
    assert args["max_model_len"] == 128 and args["max_num_seqs"] == 4
    assert args["logprobs_mode"] == "processed_logprobs" and args["load_format"] == "dummy"
    assert "tensor_parallel_size" not in args  # -1: the engine's default
    params = sampling_params(config, 3, [2], {"presence_penalty": 0.5})
    assert [p.seed for p in params] == [5, 6, 7]  # PRNGKey(5) holds [0, 5]
    first = params[0]
    assert (first.temperature, first.top_p, first.top_k, first.max_tokens) == (0.7, 1.0, 0, 16)
    assert (first.logprobs, first.stop_token_ids) == (0, [2])
    assert (first.min_p, first.presence_penalty) == (0.1, 0.5)
    assert sampling_params(base_rollout.RolloutConfig(), 2, [2], {})[1].seed is None
    padded = left_padded([[5, 6], [7, 8, 9]], 4, pad_id=0)
    np.testing.assert_array_equal(padded, [[0, 0, 5, 6], [0, 7, 8, 9]])
    assert left_padded([[1] * 5], 4, pad_id=0).shape == (1, 8)  # longer: next power of 2


def test_parameters_with_no_hf_name_and_other_models_are_refused():
    model = random_model(FAMILIES["qwen3"], seed=3)
    pairs = flat_params(nnx.state(model, nnx.Param))
    assert ("layers.1.attn.q_norm.w", (8,)) in [(k, v.shape) for k, v in pairs]
    with pytest.raises(ValueError, match="'layers.0.attn.lora_a' has no Hugging Face name"):
        list(hf_weights(family_of(model), [("layers.0.attn.lora_a", jnp.ones(2))]))
    with pytest.raises(ValueError, match="supported Tunix families: Llama3, Qwen2, Qwen3"):
        family_of(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
