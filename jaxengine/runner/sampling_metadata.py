"""Host side of sampling: per-step padded numpy arrays and the static sampler flags.

Each step the runner holds R_pad request slots (its request bucket). For every real
slot it passes a `SamplingRow` (the request's `SamplingParams`, its output and
prompt token ids, its resolved seed); empty slots are None. `SamplingBatch` turns
them into a `SamplingMetadata` (a NamedTuple of numpy arrays, a jax pytree) and
says which `SamplerFlags` the batch needs.

Design choices:

- Randomness. Row r's key is `fold_in(threefry_key(seed_r), step_r)`, where seed_r
  is the request's 64-bit seed (`request_seed()`: the user's seed, or a hash of the
  engine seed and a per-request counter) and step_r is the number of tokens the
  request has generated. A row's draw therefore depends on its seed and position
  only, never on its neighbours or its slot, and replays identically after a
  preemption (recompute keeps the generated tokens).
- Biases and bans are one sparse list per row, `bias_ids/bias_values [R, Kb]`
  (padding id -1): `logit_bias`, plus -inf for `bad_words` (single tokens, or a
  multi-token word's last token when the output ends with its prefix, checked here
  each step) and, while fewer than `min_tokens` tokens exist, for EOS and the stop
  token ids.
- Structured outputs: a row's grammar gives a dense bitmask `token_bitmask [R, W]`
  (int32, W = ceil(V / 32), bit set = allowed; -1 words allow everything, the value
  of every unconstrained and padding row), a fixed shape whatever the grammar.
- `allowed_token_ids` is a sparse allow-list `allowed_ids [R, Ka]` with a per-row
  flag `has_allowed [R]`.
- `logprob_token_ids` are `logprob_ids [R, Kl]` (padding -1): the sampler gathers
  their logprobs (and ranks) beside the sampled token's.
- Penalties read `penalty_ids [R, Lp]`: a row's output token ids followed by its
  prompt ids (prompt only when `repetition_penalty != 1`, the one penalty that looks
  at the prompt), padding -1, and `penalty_num_output [R]`. The device scatter-adds
  them into counts; duplicates are fine, so the host only copies lists.
- Static flags. Every width is a bucket, and every feature is a no-op at its
  neutral value (penalties 0/0/1, no bias, no allow-list, top_k 0, top_p 1), so a
  variant with *larger* flags is always correct, only slower: `SamplerFlags.covers`
  orders the variants and the runner may round a batch up to any compiled variant
  that covers it (`pick_variant`). The set is finite: widths are powers of 4 (of 2
  for penalties) capped by the vocabulary (by the context length for penalties).

Host-side `logits_processors` (user callables) run in `apply_logits_processors`
on numpy logits; the runner calls it before `sample()` only when a row has any. The
engine's custom processors (``--logits-processors``) run inside the compiled sampler
instead: their states join the metadata as `processor_states`
(`runner.logits_processors`).

numpy only: no jax import.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal, NamedTuple

import numpy as np

from jaxengine.sampling_params import MAX_LOGPROB_TOKEN_IDS, SamplingParams, SamplingType

LogprobsMode = Literal["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"]
_MASK64 = (1 << 64) - 1
_LOGPROB_BUCKETS = (0, 1, 5, 20)


# --------------------------------------------------------------------------- flags


@dataclass(frozen=True)
class SamplerFlags:
    """Static choices of one compiled sampler variant (hashable, for `jax.jit`).

    A larger value of any field handles every batch a smaller one handles.
    """

    all_greedy: bool = False
    """Every row is greedy: no temperature, filters or random draws are compiled."""
    filter_width: int = 0
    """0: no row uses top-k/top-p. w < vocab: every such row has 1 <= top_k <= w and
    filtering runs on `lax.top_k(logits, w)`. w == vocab: a full sort."""
    penalty_width: int = 0
    """Lp of `penalty_ids`; 0 compiles no penalties."""
    bias_width: int = 0
    """Kb of `bias_ids`; 0 compiles no biases or bans."""
    allowed_width: int = 0
    """Ka of `allowed_ids`; 0 compiles no allow-list."""
    num_logprobs: int | None = None
    """K of the top-k logprobs returned; None: no logprobs at all; 0: only the
    sampled token's logprob and rank."""
    logprobs_mode: LogprobsMode = "raw_logprobs"
    """`ModelConfig.logprobs_mode`: fixed for an engine, so it multiplies nothing."""
    token_bitmask: bool = False
    """Apply `token_bitmask` (structured outputs); False compiles no mask."""
    logprob_ids_width: int = 0
    """Kl of `logprob_ids` (`logprob_token_ids`); 0 compiles no gather of them."""

    def covers(self, other: SamplerFlags) -> bool:
        """Whether this variant computes `other`'s batches correctly."""
        if self.logprobs_mode != other.logprobs_mode:
            return False
        if self.all_greedy and not other.all_greedy:
            return False
        if other.token_bitmask and not self.token_bitmask:
            return False
        lp_self = -1 if self.num_logprobs is None else self.num_logprobs
        lp_other = -1 if other.num_logprobs is None else other.num_logprobs
        widths = (
            "filter_width",
            "penalty_width",
            "bias_width",
            "allowed_width",
            "logprob_ids_width",
        )
        return lp_self >= lp_other and all(getattr(self, f) >= getattr(other, f) for f in widths)

    def cost(self) -> int:
        """A rough ordering of variants by work, for `pick_variant`."""
        lp = 0 if self.num_logprobs is None else self.num_logprobs + 1
        random = 0 if self.all_greedy else 1 << 20
        mask = 1 << 10 if self.token_bitmask else 0
        return (
            random
            + mask
            + sum(getattr(self, f.name) for f in fields(self) if "width" in f.name)
            + lp
        )


def pick_variant(needed: SamplerFlags, compiled: Sequence[SamplerFlags]) -> SamplerFlags | None:
    """The cheapest compiled variant that covers `needed`, or None."""
    fits = [f for f in compiled if f.covers(needed)]
    return min(fits, key=SamplerFlags.cost) if fits else None


def bucket(n: int, *, start: int = 16, growth: int = 4, cap: int | None = None) -> int:
    """0 for n == 0, else the smallest `start * growth**i >= n`, at most `cap`."""
    if n <= 0:
        return 0
    b = start
    while b < n:
        b *= growth
    return b if cap is None else min(b, max(cap, n))


def logprobs_bucket(n: int | None, vocab_size: int) -> int | None:
    """Bucket of the top-k logprobs width: None, 0, 1, 5, 20, 80, 320, ... or V."""
    if n is None:
        return None
    if n == -1 or n >= vocab_size:
        return vocab_size
    for b in _LOGPROB_BUCKETS:
        if n <= b:
            return b
    return bucket(n, start=_LOGPROB_BUCKETS[-1], cap=vocab_size)


# ------------------------------------------------------------------------ metadata


class SamplingMetadata(NamedTuple):
    """Per-step sampler inputs for R request slots (a pytree of arrays).

    Padding slots hold neutral values: greedy, no penalties, no bias, no allow-list.
    """

    temperature: np.ndarray  # [R] f32, 0 = greedy
    top_k: np.ndarray  # [R] i32, 0 = off
    top_p: np.ndarray  # [R] f32, 1 = off
    min_p: np.ndarray  # [R] f32, 0 = off
    presence_penalty: np.ndarray  # [R] f32
    frequency_penalty: np.ndarray  # [R] f32
    repetition_penalty: np.ndarray  # [R] f32
    rng_key: np.ndarray  # [R, 2] u32, threefry key data of the row's seed
    rng_step: np.ndarray  # [R] u32, tokens generated so far
    penalty_ids: np.ndarray  # [R, Lp] i32, output ids then prompt ids, -1 pad
    penalty_num_output: np.ndarray  # [R] i32, how many leading penalty_ids are output
    bias_ids: np.ndarray  # [R, Kb] i32, -1 pad
    bias_values: np.ndarray  # [R, Kb] f32 (-inf bans)
    allowed_ids: np.ndarray  # [R, Ka] i32, -1 pad
    has_allowed: np.ndarray  # [R] bool
    token_bitmask: np.ndarray  # [R, W] i32, W = ceil(V / 32) (0 without the flag), -1 = all
    logprob_ids: np.ndarray  # [R, Kl] i32, -1 pad
    processor_states: tuple = ()  # each custom logits processor's state (`ProcessorBatch`)


@dataclass(frozen=True)
class SamplingRow:
    """One request slot's sampling state, as the runner knows it this step."""

    params: SamplingParams
    output_token_ids: Sequence[int]
    prompt_token_ids: Sequence[int]
    seed: int
    """The request's resolved seed (`request_seed()`), fixed for its lifetime."""
    step: int | None = None
    """Position of the token being sampled (its random draw and the ``min_tokens``
    check use it); defaults to len(output_token_ids). Larger when the request's
    previous token is still in flight (async scheduling)."""
    token_bitmask: np.ndarray | None = None
    """The grammar's allowed next tokens ([ceil(V / 32)] int32), or None."""

    @property
    def position(self) -> int:
        """`step`, or the number of known output tokens when it is None."""
        return len(self.output_token_ids) if self.step is None else self.step


def request_seed(params: SamplingParams, engine_seed: int, request_counter: int) -> int:
    """The 64-bit seed of a request: its own `seed`, else a hash of the engine seed
    and a per-request counter (so unseeded runs are reproducible per engine seed)."""
    if params.seed is not None:
        return params.seed & _MASK64
    return _splitmix64((engine_seed & _MASK64) ^ _splitmix64(request_counter + 0x5EED))


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass
class _Prepared:
    """Host lists derived from one row this step."""

    bias: dict[int, float]
    allowed: list[int] | None
    penalty_ids: list[int]
    num_output: int
    top_k: int


def _prepare(row: SamplingRow, vocab_size: int, eos_token_id: int | None) -> _Prepared:
    p, out = row.params, row.output_token_ids
    bias = dict(p.logit_bias or {})
    banned: set[int] = set()
    for word in p.bad_words_token_ids or []:
        prefix = len(word) - 1
        if prefix == 0 or (len(out) >= prefix and list(out[len(out) - prefix :]) == word[:-1]):
            banned.add(word[-1])
    if row.position < p.min_tokens:
        banned |= p.all_stop_token_ids
        if eos_token_id is not None:
            banned.add(eos_token_id)
    for tok in banned:
        bias[tok] = -math.inf
    penalized = p.has_penalties
    pen_ids: list[int] = list(out) if penalized else []
    if p.repetition_penalty != 1:
        pen_ids += list(row.prompt_token_ids)
    allowed = sorted(set(p.allowed_token_ids)) if p.allowed_token_ids is not None else None
    top_k = p.top_k if 0 < p.top_k < vocab_size else 0
    return _Prepared(bias, allowed, pen_ids, len(out) if penalized else 0, top_k)


class SamplingBatch:
    """The rows of one step, prepared once; `required_flags()` then `to_metadata()`."""

    def __init__(
        self,
        rows: Sequence[SamplingRow | None],
        num_slots: int,
        vocab_size: int,
        *,
        eos_token_id: int | None = None,
    ) -> None:
        if len(rows) > num_slots:
            raise ValueError(f"{len(rows)} rows do not fit in {num_slots} slots")
        self.rows: list[SamplingRow | None] = [*rows, *[None] * (num_slots - len(rows))]
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self._prep = [None if r is None else _prepare(r, vocab_size, eos_token_id) for r in rows]
        self._prep += [None] * (num_slots - len(rows))

    @property
    def any_logits_processors(self) -> bool:
        return any(r is not None and r.params.logits_processors for r in self.rows)

    def required_flags(self, logprobs_mode: LogprobsMode = "raw_logprobs") -> SamplerFlags:
        """The smallest variant that samples this batch correctly."""
        real = [(r, q) for r, q in zip(self.rows, self._prep, strict=True) if r is not None]
        random = [(r, q) for r, q in real if r.params.sampling_type != SamplingType.GREEDY]
        filter_width = 0
        if any(r.params.top_p < 1 and q.top_k == 0 for r, q in random):
            filter_width = self.vocab_size
        elif any(r.params.top_p < 1 or q.top_k > 0 for r, q in random):
            filter_width = bucket(max(q.top_k for _, q in random), cap=self.vocab_size)
        lps = [r.params.logprobs_top_k for r, _ in real if r.params.logprobs_top_k is not None]
        widest = self.vocab_size if -1 in lps else max(lps, default=None)
        ids = max((len(r.params.logprob_token_ids or ()) for r, _ in real), default=0)
        return SamplerFlags(
            all_greedy=not random,
            filter_width=filter_width,
            penalty_width=bucket(max((len(q.penalty_ids) for _, q in real), default=0), growth=2),
            bias_width=bucket(max((len(q.bias) for _, q in real), default=0), cap=self.vocab_size),
            allowed_width=bucket(
                max((len(q.allowed) for _, q in real if q.allowed is not None), default=0),
                cap=self.vocab_size,
            ),
            num_logprobs=logprobs_bucket(widest, self.vocab_size),
            logprobs_mode=logprobs_mode,
            token_bitmask=any(r.token_bitmask is not None for r, _ in real),
            logprob_ids_width=0 if ids == 0 else MAX_LOGPROB_TOKEN_IDS,
        )

    def to_metadata(self, flags: SamplerFlags) -> SamplingMetadata:
        """Padded arrays shaped by `flags`, which must cover `required_flags()`."""
        needed = self.required_flags(flags.logprobs_mode)
        if not flags.covers(needed):
            raise ValueError(f"sampler variant {flags} does not cover this batch ({needed})")
        R = self.num_slots
        scalars = _scalar_arrays(self.rows, self._prep)
        pen_ids = np.full((R, flags.penalty_width), -1, np.int32)  # [R, Lp]
        pen_out = np.zeros(R, np.int32)  # [R]
        bias_ids = np.full((R, flags.bias_width), -1, np.int32)  # [R, Kb]
        bias_vals = np.zeros((R, flags.bias_width), np.float32)  # [R, Kb]
        allowed_ids = np.full((R, flags.allowed_width), -1, np.int32)  # [R, Ka]
        has_allowed = np.zeros(R, bool)  # [R]
        width = -(-self.vocab_size // 32) if flags.token_bitmask else 0
        token_bitmask = np.full((R, width), -1, np.int32)  # [R, W]
        logprob_ids = np.full((R, flags.logprob_ids_width), -1, np.int32)  # [R, Kl]
        for i, q in enumerate(self._prep):
            if q is None:
                continue
            pen_ids[i, : len(q.penalty_ids)] = q.penalty_ids
            pen_out[i] = q.num_output
            if q.bias:
                bias_ids[i, : len(q.bias)] = list(q.bias)
                bias_vals[i, : len(q.bias)] = list(q.bias.values())
            if q.allowed is not None:
                allowed_ids[i, : len(q.allowed)] = q.allowed
                has_allowed[i] = True
            row = self.rows[i]
            if row is not None and row.token_bitmask is not None:
                token_bitmask[i] = row.token_bitmask
            wanted = row.params.logprob_token_ids if row is not None else None
            if wanted:
                logprob_ids[i, : len(wanted)] = wanted
        return SamplingMetadata(
            **scalars,
            penalty_ids=pen_ids,
            penalty_num_output=pen_out,
            bias_ids=bias_ids,
            bias_values=bias_vals,
            allowed_ids=allowed_ids,
            has_allowed=has_allowed,
            token_bitmask=token_bitmask,
            logprob_ids=logprob_ids,
        )


def _scalar_arrays(
    rows: Sequence[SamplingRow | None], prep: Sequence[_Prepared | None]
) -> dict[str, np.ndarray]:
    R = len(rows)
    out = {
        "temperature": np.zeros(R, np.float32),
        "top_k": np.zeros(R, np.int32),
        "top_p": np.ones(R, np.float32),
        "min_p": np.zeros(R, np.float32),
        "presence_penalty": np.zeros(R, np.float32),
        "frequency_penalty": np.zeros(R, np.float32),
        "repetition_penalty": np.ones(R, np.float32),
        "rng_key": np.zeros((R, 2), np.uint32),
        "rng_step": np.zeros(R, np.uint32),
    }
    for i, (row, q) in enumerate(zip(rows, prep, strict=True)):
        if row is None or q is None:
            continue
        p = row.params
        greedy = p.sampling_type == SamplingType.GREEDY
        out["temperature"][i] = 0.0 if greedy else p.temperature
        out["top_k"][i] = q.top_k
        out["top_p"][i] = p.top_p
        out["min_p"][i] = p.min_p
        out["presence_penalty"][i] = p.presence_penalty
        out["frequency_penalty"][i] = p.frequency_penalty
        out["repetition_penalty"][i] = p.repetition_penalty
        seed = row.seed & _MASK64
        out["rng_key"][i] = (seed >> 32, seed & 0xFFFFFFFF)
        out["rng_step"][i] = row.position
    return out


def build_sampling_metadata(
    rows: Sequence[SamplingRow | None],
    num_slots: int,
    vocab_size: int,
    *,
    eos_token_id: int | None = None,
    flags: SamplerFlags | None = None,
    logprobs_mode: LogprobsMode = "raw_logprobs",
) -> tuple[SamplingMetadata, SamplerFlags]:
    """One-call form: the metadata and the flags used (the required ones if None)."""
    batch = SamplingBatch(rows, num_slots, vocab_size, eos_token_id=eos_token_id)
    flags = flags or batch.required_flags(logprobs_mode)
    return batch.to_metadata(flags), flags


# ------------------------------------------------------------- logits processors


def apply_logits_processors(logits: np.ndarray, rows: Sequence[SamplingRow | None]) -> np.ndarray:
    """Runs each row's host `logits_processors` on its logits ([R, V] -> [R, V]).

    A processor takes `(output_token_ids, logits)` or `(prompt_token_ids,
    output_token_ids, logits)`, as in vLLM, and returns the new logits row.
    """
    logits = np.array(logits, np.float32, copy=True)  # [R, V]
    for i, row in enumerate(rows):
        if row is None or not row.params.logits_processors:
            continue
        out_ids, prompt_ids = list(row.output_token_ids), list(row.prompt_token_ids)
        for proc in row.params.logits_processors:
            if _num_positional_args(proc) >= 3:
                logits[i] = proc(prompt_ids, out_ids, logits[i])
            else:
                logits[i] = proc(out_ids, logits[i])
    return logits


def _num_positional_args(fn: object) -> int:
    try:
        params = inspect.signature(fn).parameters.values()  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 2
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds for p in params)


def step_sampling_rows(out: Any, order: list[str], states: list, fed: list) -> list:
    """Each scheduled request's `SamplingRow`s (with its grammar bitmask row, if
    any): one, or one more per proposal it verifies (with the proposals before
    it among its outputs), or None for a request mid-prefill (it samples
    nothing). A fed request's row counts its token in flight."""
    spec = out.scheduled_spec_decode_tokens
    masks, row = {}, 0
    for r in out.structured_output_req_ids:  # 1 + proposals rows each
        n = 1 + len(spec.get(r, ()))
        masks[r], row = out.grammar_bitmask[row : row + n], row + n
    return [
        None
        if r in out.partial_req_ids
        else request_rows(s, spec.get(r, ()), f is not None, masks.get(r))
        for r, s, f in zip(order, states, fed, strict=True)
    ]


def request_rows(state: Any, drafts: tuple[int, ...], fed: bool, masks) -> list[SamplingRow]:
    """A request's sampling rows: after its last token, then after each proposal (with
    its grammar's mask at that point, if any)."""
    step = len(state.token_ids) - state.num_prompt + fed
    prompt = state.token_ids[: state.num_prompt]
    outputs = state.output_ids
    return [
        SamplingRow(
            state.params,
            [*outputs, *drafts[:j]],
            prompt,
            state.seed,
            step + j,
            None if masks is None else masks[j],
        )
        for j in range(1 + len(drafts))
    ]
