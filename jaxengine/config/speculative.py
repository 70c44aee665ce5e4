"""SpeculativeConfig: speculative decoding, configured as vLLM configures it.

`--speculative-config '{"method": "ngram", "num_speculative_tokens": 4, ...}'` (JSON,
or dotted keys) and `LLM(speculative_config={...})`. The keys are vLLM's; a key
it does not know fails at parse time naming the key. `unsupported.py` refuses the
methods that do not run yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxengine.config.utils import require, validate_config

SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp")
"""vLLM's method names."""
_MTP_ALIASES = ("deepseek_mtp",)
"""Older names of "mtp" that vLLM still accepts (it warns and replaces them)."""
_DRAFT_KEYS = ("model", "revision", "quantization")
"""What names a separate draft model (no such model with "mtp": the target drafts)."""

_KEYS = frozenset(
    {
        "method",
        "num_speculative_tokens",
        "model",
        "prompt_lookup_min",
        "prompt_lookup_max",
        "disable_by_batch_size",
        "draft_tensor_parallel_size",
        "max_model_len",
        "quantization",
        "revision",
        "code_revision",
        "disable_padded_drafter_batch",
        "speculative_token_tree",
    }
)
_NGRAM_DEFAULT = 5  # prompt_lookup_min/max when neither is given (as vLLM)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: proposals verified by the target model in one step."""

    speculative_config: dict | None = None
    """Speculative decoding configuration (JSON). Keys as vLLM's: "method" ("ngram",
    "draft_model", "eagle", "mtp": the target checkpoint's own multi-token-prediction
    layer, DeepSeek-V3's, drafting on the target's hidden states with its own KV cache,
    "deepseek_mtp" an older name for it; "eagle3", "medusa" and "mlp_speculator" are not
    supported yet), "num_speculative_tokens" (proposals verified per step),
    "prompt_lookup_min" / "prompt_lookup_max" (the n-gram sizes ngram matches against
    the request's own tokens; default 5 each), "model" (a draft model; "ngram" or
    "[ngram]" selects ngram; a name containing "eagle" an EAGLE head: a checkpoint
    in the EAGLE layout, run on the target's hidden states; any other path or name a
    draft model of the same vocabulary; both run greedily on the target's devices
    with their own KV cache),
    "disable_by_batch_size" (no proposals while this many requests or more are
    running), "quantization" and "revision" (the draft model's)."""

    def __post_init__(self) -> None:
        validate_config(self)
        options = self.speculative_config
        if not options:
            return
        unknown = sorted(set(options) - _KEYS)
        require(
            not unknown, "speculative_config", f"unknown key(s) {unknown}; known: {sorted(_KEYS)}"
        )
        require(
            self.method in SPECULATIVE_METHODS,
            "speculative_config",
            f"method {self.method!r} is not one of {list(SPECULATIVE_METHODS)}",
        )
        k = options.get("num_speculative_tokens")
        require(
            isinstance(k, int) and not isinstance(k, bool) and k >= 1,
            "speculative_config",
            f"num_speculative_tokens must be an integer >= 1, got {k!r}",
        )
        if self.method == "ngram":
            self._check_ngram()
        if self.method in ("draft_model", "eagle"):
            require(
                isinstance(options.get("model"), str) and options["model"],
                "speculative_config",
                f'the {self.method} method needs "model": the draft model\'s or EAGLE '
                "head's path or name",
            )
        if self.method == "mtp":
            given = [key for key in _DRAFT_KEYS if options.get(key) is not None]
            require(
                not given,
                "speculative_config",
                f"the mtp method drafts with the target checkpoint's own multi-token-"
                f"prediction layer: drop {given}",
            )
        batch = options.get("disable_by_batch_size")
        require(
            batch is None or (isinstance(batch, int) and batch >= 2),
            "speculative_config",
            f"disable_by_batch_size must be an integer >= 2, got {batch!r}",
        )

    def _check_ngram(self) -> None:
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        for key, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            require(
                isinstance(value, int) and value >= 1,
                "speculative_config",
                f"{key} must be an integer >= 1, got {value!r}",
            )
        require(
            low <= high,
            "speculative_config",
            f"prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})",
        )

    def option(self, key: str, default: Any = None) -> Any:
        return (self.speculative_config or {}).get(key, default)

    @property
    def enabled(self) -> bool:
        return bool(self.speculative_config)

    @property
    def method(self) -> str | None:
        """The method, inferred from "model" as vLLM does when "method" is absent."""
        if not self.enabled:
            return None
        method = self.option("method")
        if method in _MTP_ALIASES:
            return "mtp"
        if method is not None:
            return method
        model = self.option("model")
        if model in ("ngram", "[ngram]"):
            return "ngram"
        if model is not None and "eagle3" in str(model).lower():
            return "eagle3"
        if model is not None and "eagle" in str(model).lower():
            return "eagle"
        return "draft_model"

    @property
    def num_speculative_tokens(self) -> int:
        """Proposals per request per step (0: speculative decoding is off)."""
        return self.option("num_speculative_tokens", 0) if self.enabled else 0

    @property
    def prompt_lookup_min(self) -> int:
        low, high = self.option("prompt_lookup_min"), self.option("prompt_lookup_max")
        return low if low is not None else (high if high is not None else _NGRAM_DEFAULT)

    @property
    def prompt_lookup_max(self) -> int:
        low, high = self.option("prompt_lookup_min"), self.option("prompt_lookup_max")
        return high if high is not None else (low if low is not None else _NGRAM_DEFAULT)

    @property
    def disable_by_batch_size(self) -> int | None:
        return self.option("disable_by_batch_size")
