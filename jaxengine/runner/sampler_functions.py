"""The compiled sampler: its variants, its calls and their warm-up.

The sampler is one jitted function with its `SamplerFlags` static: each variant is a
compiled program. `SamplerFunctions` fixes the variants an engine precompiles (so a
batch mixing any requests runs one of them and compiles nothing), keeps their
executables (through the `ExecutableStore`, when there is one, so a restart loads them
without tracing), runs them, and puts host logits back where the step leaves them (the
host logits-processor path). The engine's custom logits processors
(``--logits-processors``) are traced into every variant; their states are sized by
the row count, so they add no variant. Their code is the user's, outside what the
`ExecutableStore` hashes, so an engine with processors stores no sampler executables
(the built-in thinking-budget processor, `reasoning.budget_processor`, is hashed).

The structured-output bitmask is its own small program (`apply_token_bitmask`, one
per row count): a batch with constrained rows runs it on the logits, then the variant
without the mask. So the masked variants cost one program per row count, not a second
compile of every variant; the logprobs still see the masked logits, as in vLLM.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.runner.executables import compile_ahead, process_shared
from jaxengine.runner.logits_processors import ProcessorBatch
from jaxengine.runner.sampler import apply_token_bitmask
from jaxengine.runner.sampling_metadata import (
    SamplerFlags,
    SamplingBatch,
    logprobs_bucket,
)
from jaxengine.runner.sampling_metadata import (
    bucket as width_bucket,
)
from jaxengine.runner.step import make_sampler
from jaxengine.runner.transfer import pack_tree
from jaxengine.sampling_params import MAX_LOGPROB_TOKEN_IDS

if TYPE_CHECKING:
    from jax.sharding import Sharding

    from jaxengine.runner.executables import ExecutableStore

BIAS_WIDTH = 1024  # logit_bias entries + banned tokens covered by the precompiled variant
ALLOWED_WIDTH = 1024  # allowed_token_ids covered by the precompiled variant


class SamplerFunctions:
    """The jitted sampler of one engine and the variants it precompiles."""

    def __init__(
        self,
        vocab_size: int,
        *,
        max_logprobs: int,
        logprobs_mode: str,
        max_model_len: int,
        max_num_seqs: int,
        logits_sharding: Sharding | None,
        store: ExecutableStore | None = None,
        processors: ProcessorBatch | None = None,
    ) -> None:
        """The sampled ids come back padded to ``max_num_seqs`` (a next step can read
        them on device whatever the batch size: async scheduling). ``processors``:
        the custom logits processors (`runner.logits_processors`), or None."""
        self.vocab_size = vocab_size
        self.logits_sharding = logits_sharding
        self.processors = processors or ProcessorBatch(())
        self.store = None if self.processors.custom else store
        self._sampler = make_sampler(max_num_seqs, logits_sharding, self.processors.processors)
        self.max_num_seqs = max_num_seqs
        self._compiled: dict[tuple, Any] = {}  # (metadata spec, flags) -> executable
        self._mask = jax.jit(apply_token_bitmask)
        self._masks: dict[int, Any] = {}  # rows -> compiled mask
        self.variants = sampler_variants(vocab_size, max_logprobs, logprobs_mode, max_model_len)

    def to_device(self, logits: np.ndarray):
        """Host logits placed as the step leaves them (the logits-processor path)."""
        if self.logits_sharding is None:
            return jnp.asarray(logits)
        return jax.device_put(logits, self.logits_sharding)

    def feed_shape(self) -> jax.ShapeDtypeStruct:
        """The sampled ids' shape and placement (what `to_device` gives a step's
        ``fed_ids``), for a compile-only engine."""
        return _placed((self.max_num_seqs,), jnp.int32, self.logits_sharding)

    def sample(self, logits, metadata, flags: SamplerFlags):
        if flags.token_bitmask:  # the mask first, then the variant without it
            rows = metadata.token_bitmask.shape[0]
            logits = self._masks.get(rows, self._mask)(logits, metadata.token_bitmask)
            metadata = metadata._replace(token_bitmask=np.zeros((rows, 0), np.int32))
            flags = dataclasses.replace(flags, token_bitmask=False)
        buffers, spec = pack_tree(metadata)
        compiled = self._compiled.get((spec, flags))
        if compiled is not None:
            return compiled(logits, buffers)
        return self._sampler(logits, buffers, spec=spec, flags=flags)

    def warm(self, num_reqs: int, flags: SamplerFlags) -> None:
        """Compiles (or loads) the variant ``flags`` for ``num_reqs`` rows (with the
        bitmask: the mask program and the variant without it)."""
        logits = self._abstract_logits(num_reqs)
        if flags.token_bitmask:
            self._warm_mask(num_reqs, logits)
            flags = dataclasses.replace(flags, token_bitmask=False)
        metadata = SamplingBatch([], num_reqs, self.vocab_size).to_metadata(flags)
        metadata = metadata._replace(processor_states=self.processors.template(num_reqs))
        buffers, spec = pack_tree(metadata)
        key = (spec, flags)
        if key in self._compiled:
            return

        def lower():
            return self._sampler.lower(logits, buffers, spec=spec, flags=flags)

        self._compiled[key] = self._compile("sampler", key, lower)

    def _warm_mask(self, num_reqs: int, logits) -> None:
        if num_reqs in self._masks:
            return
        bitmask = jax.ShapeDtypeStruct((num_reqs, -(-self.vocab_size // 32)), jnp.int32)
        key = (num_reqs, self.vocab_size)
        lower = functools.partial(self._mask.lower, logits, bitmask)
        self._masks[num_reqs] = self._compile("sampler.mask", key, lower)

    def _compile(self, name: str, key: tuple, lower) -> Any:
        """``lower().compile()`` through the store, shared by the process's engines
        (`process_shared`) when no logits processor is traced in: the program is then
        fixed by the vocabulary, the slots, the placement and ``key``. A store that is
        not ``shareable`` (the compile check's recorder) sees every compile itself."""
        build = functools.partial(compile_ahead, self.store, name, key, lower)
        if self.processors or not getattr(self.store, "shareable", True):
            return build()
        device = jax.config.values.get("jax_default_device")
        program = (name, key, self.vocab_size, self.max_num_seqs, self.logits_sharding, device)
        return process_shared(program, build)

    def _abstract_logits(self, num_reqs: int) -> jax.ShapeDtypeStruct:
        return _placed((num_reqs, self.vocab_size), jnp.float32, self.logits_sharding)


def _placed(shape: tuple, dtype: Any, sharding: Sharding | None) -> jax.ShapeDtypeStruct:
    if sharding is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def sampler_variants(
    vocab: int, max_logprobs: int, mode: str, max_model_len: int
) -> list[SamplerFlags]:
    """Greedy; greedy with logprobs; temperature + filters; everything; and each
    again with the structured-output bitmask (a batch mixing constrained and free
    requests runs one of those and compiles nothing; the masked ones are the mask
    program followed by their unmasked twin, `SamplerFunctions`).

    The filter variants sort the whole vocabulary only in steps where a random row
    asks top-k or top-p (`sampler.filter_logits`): temperature alone (vLLM's default
    request, temperature 1) runs them without the sort, which on a CPU costs several
    times the rest of the sampler (bench/README.md), and needs no program of its own.

    "Everything" also gathers `logprob_token_ids`: a batch naming ids runs it. Its
    ranks sort the vocabulary only in steps where a row names ids (`lax.cond`), so
    the other batches that need it pay nothing for them."""
    k = logprobs_bucket(max_logprobs, vocab)
    base = [
        SamplerFlags(all_greedy=True, logprobs_mode=mode),
        SamplerFlags(all_greedy=True, num_logprobs=k, logprobs_mode=mode),
        SamplerFlags(filter_width=vocab, num_logprobs=k, logprobs_mode=mode),
        SamplerFlags(
            filter_width=vocab,
            penalty_width=width_bucket(max_model_len, growth=2),
            bias_width=width_bucket(BIAS_WIDTH, cap=vocab),
            allowed_width=width_bucket(ALLOWED_WIDTH, cap=vocab),
            num_logprobs=k,
            logprobs_mode=mode,
            logprob_ids_width=MAX_LOGPROB_TOKEN_IDS,
        ),
    ]
    return base + [dataclasses.replace(f, token_bitmask=True) for f in base]
