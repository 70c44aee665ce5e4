"""Beam search driven from the host: vLLM's API with transformers' semantics.

vLLM's API: `BeamSearchParams` in, one `BeamSearchOutput` of `BeamSearchSequence`s
per prompt out (``LLM.beam_search``; the server's ``use_beam_search``). As vLLM v1
does, the engine knows nothing of beams: each step of a search submits one request
per live beam (the prompt plus the beam's tokens, ``max_tokens=1``, ``logprobs=K``)
and reads the top-K log probabilities back. With prefix caching (on by default) the
beams' full pages are shared through the prefix cache, so a step recomputes only each
beam's last partial page; without it every step recomputes every beam (same outputs,
slower).

The selection follows transformers' ``generate(num_beams=k, do_sample=False)``
(``GenerationMixin._beam_search``) exactly:

- Candidates: every live beam's tokens scored by cumulative log probability; the top
  ``K = max(2, 1 + #EOS ids) * k`` over all beams are kept, best first.
- A candidate *ends* when its token is an EOS id or it reaches ``max_tokens``. The
  next live beams are the best k candidates that did not end.
- Only ended candidates among the first k of the K become hypotheses (an EOS at rank
  k or later is dropped), scored ``cum_logprob / generated_len ** length_penalty``
  where ``generated_len`` counts the EOS token. The best k hypotheses are kept.
  At ``max_tokens`` every candidate ends, so the first k of the last step (the
  unfinished beams) become hypotheses too.
- The search stops when every candidate ended, or once k hypotheses exist and:
  ``early_stopping=True``: at once; ``False`` (transformers' default): when the best
  live beam's ``cum_logprob / generated_len ** length_penalty`` is no better than the
  worst hypothesis; ``"never"``: the same with ``max_tokens`` as the length when
  ``length_penalty > 0`` (the best a live beam could still reach).

vLLM's own v1 loop differs (every EOS among the candidates completes a beam, the
score divides by the prompt-and-output length, and it always runs ``max_tokens``
steps); this module matches transformers so that outputs can be checked against it.
``early_stopping`` is vLLM v0's (and transformers') name for the stopping rule, with
the same default (False).

Nothing here imports jax: the algorithm is `BeamSearch` (one prompt, stepped by its
caller), and `run_beam_searches` drives several with any batch scorer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence
from typing import Any

from jaxengine.outputs import CompletionOutput, Logprob, RequestOutput
from jaxengine.sampling_params import RequestOutputKind, SamplingParams

StepLogprobs = dict[int, Logprob]
"""One beam's next-token log probabilities (at least the top K tokens)."""


@dataclasses.dataclass
class BeamSearchParams:
    """Beam search parameters (vLLM's `BeamSearchParams`)."""

    beam_width: int
    """Beams kept at each step, and sequences returned."""
    max_tokens: int
    """Tokens generated at most per sequence."""
    ignore_eos: bool = False
    """Do not end a beam on EOS (every sequence runs ``max_tokens``)."""
    temperature: float = 0.0
    """The temperature of each step's request, as vLLM: the scores are the engine's
    log probabilities, so it changes them only with ``--logprobs-mode
    processed_logprobs``."""
    length_penalty: float = 1.0
    """A hypothesis scores ``cum_logprob / generated_len ** length_penalty``: above 0
    favours longer sequences, below 0 shorter ones."""
    include_stop_str_in_output: bool = False
    """Keep the EOS token at the end of a sequence that ended on it."""
    early_stopping: bool | str = False
    """When the search stops (transformers' and vLLM v0's name): True, False or "never"
    (see the module docstring)."""

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int):
            raise ValueError(f"beam_width must be an int, got {self.beam_width!r}")
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an int, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(
                f"early_stopping must be true, false or 'never', got {self.early_stopping!r}"
            )


@dataclasses.dataclass
class BeamSearchSequence:
    """One sequence of a beam search (vLLM's `BeamSearchSequence`)."""

    tokens: list[int]
    """The prompt's tokens, then the generated ones."""
    logprobs: list[StepLogprobs]
    """One dict per generated token: the top-K tokens of its step."""
    lora_request: Any = None
    cum_logprob: float = 0.0
    """Sum of the generated tokens' log probabilities (an EOS that ended it included)."""
    text: str | None = None
    """The decoded ``tokens`` (filled when the search returns)."""
    finish_reason: str | None = None
    """"stop" (EOS) or "length" (``max_tokens``)."""
    stop_reason: int | str | None = None


@dataclasses.dataclass
class BeamSearchOutput:
    """A prompt's beam search result: its best ``beam_width`` sequences, best first."""

    sequences: list[BeamSearchSequence]


@dataclasses.dataclass(frozen=True)
class _Beam:
    tokens: tuple[int, ...]  # generated tokens
    logprobs: tuple[StepLogprobs, ...]  # one dict per generated token
    cum_logprob: float


@dataclasses.dataclass(frozen=True)
class _Hypothesis:
    score: float  # cum_logprob / generated_len ** length_penalty
    beam: _Beam
    on_eos: bool


def eos_token_ids(eos_token_id: int | None, generation_config: dict | None) -> set[int]:
    """The ids that end a beam: the model's EOS and its generation config's."""
    ids = set() if eos_token_id is None else {eos_token_id}
    extra = (generation_config or {}).get("eos_token_id")
    if extra is not None:
        ids.update([extra] if isinstance(extra, int) else extra)
    return ids


class BeamSearch:
    """One prompt's beam search, stepped by whoever scores its beams.

    Invariants: `live()` lists the token ids (prompt + tokens) of each live beam, best
    first; `advance` takes one `StepLogprobs` per live beam, in that order, holding at
    least `num_candidates` entries; once `finished`, `output()` gives the sequences.
    """

    def __init__(
        self,
        prompt_token_ids: Sequence[int],
        params: BeamSearchParams,
        eos_ids: Collection[int],
        lora_request: Any = None,
    ) -> None:
        self.prompt = list(prompt_token_ids)
        self.params = params
        self.eos = frozenset() if params.ignore_eos else frozenset(eos_ids)
        self.num_candidates = max(2, 1 + len(self.eos)) * params.beam_width
        """K: candidates kept per step, and the logprobs each step asks for."""
        self.lora_request = lora_request
        self.finished = False
        self._running = [_Beam((), (), 0.0)]
        self._hypotheses: list[_Hypothesis] = []  # best first, at most beam_width
        self._generated = 0

    def live(self) -> list[list[int]]:
        """The token ids to score next: one list per live beam (none once finished)."""
        if self.finished:
            return []
        return [self.prompt + list(beam.tokens) for beam in self._running]

    def step_params(self, logprobs: int | None = None) -> SamplingParams:
        """A step request's params: one token, with the top-K log probabilities (or
        ``logprobs`` of them if more are wanted in the output)."""
        return SamplingParams(
            max_tokens=1,
            temperature=self.params.temperature,
            logprobs=max(self.num_candidates, logprobs or 0),
            ignore_eos=True,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def advance(self, step_logprobs: Sequence[StepLogprobs]) -> None:
        """One step: ``step_logprobs[i]`` is live beam i's next-token distribution."""
        if self.finished:
            raise RuntimeError("advance() on a finished beam search")
        if len(step_logprobs) != len(self._running):
            raise ValueError(f"{len(step_logprobs)} logprobs for {len(self._running)} beams")
        width = self.params.beam_width
        self._generated += 1
        candidates = self._candidates(step_logprobs)
        ends = [self._ends(beam) for beam in candidates]
        self._running = [b for b, end in zip(candidates, ends, strict=True) if not end][:width]
        for beam, end in zip(candidates[:width], ends[:width], strict=True):
            if end:
                self._add_hypothesis(beam)
        self.finished = all(ends) or self._done()

    def output(self, decode: Callable[[list[int]], str] | None = None) -> BeamSearchOutput:
        """The best ``beam_width`` sequences, best first; ``decode(tokens)`` gives
        each one's text (vLLM decodes the prompt and the output together)."""
        if not self.finished:
            raise RuntimeError("output() before the beam search finished")
        sequences = []
        for hyp in self._hypotheses:
            tokens, logprobs = self._kept(hyp)
            seq = BeamSearchSequence(
                tokens=self.prompt + tokens,
                logprobs=logprobs,
                lora_request=self.lora_request,
                cum_logprob=hyp.beam.cum_logprob,
                finish_reason="stop" if hyp.on_eos else "length",
            )
            if decode is not None:
                seq.text = decode(seq.tokens)
            sequences.append(seq)
        return BeamSearchOutput(sequences)

    def request_output(
        self,
        request_id: str,
        prompt_text: str | None,
        decode: Callable[[list[int]], str] | None,
        with_logprobs: bool,
    ) -> RequestOutput:
        """The finished search as one final `RequestOutput` (the server's view): one
        `CompletionOutput` per sequence, best first; its text leaves out the prompt
        and an EOS token."""
        outputs = []
        for index, seq in enumerate(self.output().sequences):
            generated = seq.tokens[len(self.prompt) :]
            shown = generated
            if seq.finish_reason == "stop" and generated and generated[-1] in self.eos:
                shown = generated[:-1]
            outputs.append(
                CompletionOutput(
                    index=index,
                    text=decode(shown) if decode is not None else "",
                    token_ids=generated,
                    cumulative_logprob=seq.cum_logprob,
                    logprobs=seq.logprobs if with_logprobs else None,
                    finish_reason=seq.finish_reason,
                )
            )
        return RequestOutput(
            request_id, prompt_text, list(self.prompt), None, outputs, finished=True,
            lora_request=self.lora_request,
        )  # fmt: skip

    # ------------------------------------------------------------------ details

    def _candidates(self, step_logprobs: Sequence[StepLogprobs]) -> list[_Beam]:
        """The top K continuations over all live beams, best first (ties: earlier
        beams, then higher-ranked tokens)."""
        k = self.num_candidates
        found = []
        for beam, entries in zip(self._running, step_logprobs, strict=True):
            top = sorted(entries.items(), key=lambda item: -item[1].logprob)[:k]
            for token, lp in top:
                found.append(
                    _Beam(
                        beam.tokens + (token,),
                        beam.logprobs + (entries,),
                        beam.cum_logprob + lp.logprob,
                    )
                )
        found.sort(key=lambda b: -b.cum_logprob)
        return found[:k]

    def _ends(self, beam: _Beam) -> bool:
        return beam.tokens[-1] in self.eos or len(beam.tokens) >= self.params.max_tokens

    def _add_hypothesis(self, beam: _Beam) -> None:
        score = beam.cum_logprob / (len(beam.tokens) ** self.params.length_penalty)
        on_eos = beam.tokens[-1] in self.eos
        self._hypotheses.append(_Hypothesis(score, beam, on_eos))
        # stable: an older hypothesis stays ahead of a new one with the same score
        self._hypotheses.sort(key=lambda h: -h.score)
        del self._hypotheses[self.params.beam_width :]

    def _done(self) -> bool:
        """Whether no live beam can improve on the hypotheses (transformers' rules)."""
        params = self.params
        if len(self._hypotheses) < params.beam_width:
            return False
        if params.early_stopping is True:
            return True
        length = self._generated
        if params.early_stopping == "never" and params.length_penalty > 0:
            length = params.max_tokens
        best = self._running[0].cum_logprob / (length**params.length_penalty)
        return best <= self._hypotheses[-1].score

    def _kept(self, hyp: _Hypothesis) -> tuple[list[int], list[StepLogprobs]]:
        """A hypothesis' output tokens and their logprobs (EOS dropped unless
        ``include_stop_str_in_output``)."""
        tokens, logprobs = list(hyp.beam.tokens), list(hyp.beam.logprobs)
        if hyp.on_eos and not self.params.include_stop_str_in_output:
            tokens, logprobs = tokens[:-1], logprobs[:-1]
        return tokens, logprobs


BatchScorer = Callable[[Sequence[tuple[BeamSearch, list[int]]]], Sequence[StepLogprobs]]
"""Scores a batch of (search, token ids) pairs: each one's next-token logprobs."""


def run_beam_searches(
    searches: Sequence[BeamSearch],
    score: BatchScorer,
    on_step: Callable[[], None] | None = None,
) -> None:
    """Steps every search to the end; each step scores all their live beams at once."""
    while live := [s for s in searches if not s.finished]:
        batch = [(s, ids) for s in live for ids in s.live()]
        results = list(score(batch))
        if len(results) != len(batch):
            raise ValueError(f"the scorer returned {len(results)} results for {len(batch)}")
        start = 0
        for search in live:
            count = len(search.live())
            search.advance(results[start : start + count])
            start += count
        if on_step is not None:
            on_step()


def check_engine(search: BeamSearch, model_config: Any) -> None:
    """Refuses (ValueError) a search the engine cannot score: logits instead of log
    probabilities (``--logprobs-mode *_logits``), or more candidates per beam than
    ``--max-logprobs``."""
    if model_config.logprobs_mode.endswith("logits"):
        raise ValueError(
            f"beam search scores log probabilities, but --logprobs-mode "
            f"{model_config.logprobs_mode} returns logits"
        )
    max_logprobs = model_config.max_logprobs
    if max_logprobs != -1 and search.num_candidates > max_logprobs:
        raise ValueError(
            f"beam search with beam_width {search.params.beam_width} scores "
            f"{search.num_candidates} candidates per beam, more than the engine's "
            f"max_logprobs ({max_logprobs}); raise --max-logprobs or lower the beam width"
        )
