"""ModelConfig: which model to run, its tokenizer, dtype, context length and outputs."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from jaxengine.config.utils import require, spec, validate_config

TokenizerMode = Literal["auto", "slow", "mistral", "custom"]
ModelDType = Literal["auto", "half", "float16", "bfloat16", "float", "float32"]
ModelImpl = Literal["auto", "jax", "vllm", "transformers"]
RunnerType = Literal["auto", "draft", "generate", "pooling"]
ConvertType = Literal["auto", "none", "embed", "classify", "reward"]
TaskOption = Literal[
    "auto", "classify", "draft", "embed", "embedding", "generate", "reward", "score",
    "transcription",
]  # fmt: skip
TASK_RUNNERS: dict[str, tuple[str, str]] = {
    "generate": ("generate", "auto"),
    "embed": ("pooling", "embed"),
    "embedding": ("pooling", "embed"),
    "classify": ("pooling", "classify"),
    "score": ("pooling", "classify"),
    "reward": ("pooling", "reward"),
    "draft": ("draft", "auto"),
    "transcription": ("generate", "auto"),
}
"""The deprecated --task -> (--runner, --convert), as vLLM maps them."""
POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL")
POOLER_KEYS = frozenset({"pooling_type", "normalize", "dimensions"})
LogprobsMode = Literal["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"]
# vLLM's quantization methods, and "int8" (weight-only int8). They all parse so that
# a user gets "not supported yet" (see unsupported.py) rather than "invalid choice";
# "gguf", "int8", "fp8" and the checkpoint formats of `jaxengine.loader.quantized`
# (gptq, awq, compressed-tensors, and their _marlin names) run today.
QuantizationMethod = Literal[
    "aqlm", "awq", "awq_marlin", "auto-round", "bitblas", "bitsandbytes",
    "compressed-tensors", "deepspeedfp", "experts_int8", "fbgemm_fp8", "fp8", "gguf",
    "gptq", "gptq_bitblas", "gptq_marlin", "gptq_marlin_24", "hqq", "inc", "int8", "ipex",
    "marlin", "modelopt", "modelopt_fp4", "moe_wna16", "mxfp4", "neuron_quant",
    "ptpc_fp8", "qqq", "quark", "rtn", "torchao", "tpu_int8",
]  # fmt: skip

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
CPU_FLAGS_FILE = Path("/proc/cpuinfo")


@functools.cache
def cpu_has_amx_bf16(cpuinfo: Path = CPU_FLAGS_FILE) -> bool:
    """Whether this host's CPU reports AMX-BF16 (Linux ``/proc/cpuinfo`` flags), where
    XLA:CPU runs a bfloat16 dot accumulated in float32 at about five times its float32
    matmul rate (bench/README.md). False where the file cannot be read."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    flags = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return "amx_bf16" in flags.split()


def auto_dtype(platform: str | None, pooling: bool) -> str:
    """What ``--dtype auto`` is before the load: ``bfloat16`` for a pooling model on a
    CPU with AMX-BF16, where a whole prompt per step makes the projections large dots
    (about 2x the float32 throughput); else ``auto`` (`loader.resolve_dtype`: the
    checkpoint's dtype, float32 on CPU). vLLM's ``auto`` also runs float32 pooling
    checkpoints in 16 bits."""
    return "bfloat16" if platform == "cpu" and pooling and cpu_has_amx_bf16() else "auto"


@dataclass(frozen=True)
class ModelConfig:
    """Configuration for the model."""

    model: str = DEFAULT_MODEL
    """Name or path of the model to use: a local directory, a .gguf file, a Hugging
    Face repo id, or a demo model name. It is also the served model name when
    --served-model-name is not given."""
    tokenizer: str | None = None
    """Name or path of the Hugging Face tokenizer to use. If unspecified, the model
    name or path is used."""
    tokenizer_mode: TokenizerMode = "auto"
    """Tokenizer mode: "auto" uses the fast tokenizer if available, "slow" always uses
    the slow tokenizer. "mistral" and "custom" are not supported yet."""
    model_impl: ModelImpl = "auto"
    """Which implementation of the model to use. "auto" runs the JAX (Flax) port when
    the architecture has one and falls back to transformers' PyTorch model otherwise;
    "jax" (or vLLM's "vllm") requires the JAX port; "transformers" always runs
    transformers' model (`torch_fallback`), under the same scheduler and KV cache."""
    trust_remote_code: bool = False
    """Trust remote code (e.g. from Hugging Face) when loading the model config and
    tokenizer."""
    revision: str | None = None
    """The specific model version to use: a branch name, a tag name, or a commit id.
    If unspecified, the default version is used."""
    code_revision: str | None = None
    """The specific revision to use for the model code on the Hugging Face Hub: a
    branch name, a tag name, or a commit id. If unspecified, the default version is
    used. jaxengine runs no model code from the hub, so any other value is not
    supported yet."""
    tokenizer_revision: str | None = None
    """The specific revision to use for the tokenizer on the Hugging Face Hub: a
    branch name, a tag name, or a commit id."""
    dtype: ModelDType = "auto"
    """Data type for model weights and activations. "auto" uses the checkpoint's
    dtype (bfloat16 for FP32/FP16/BF16 checkpoints on accelerators) and float32 on
    CPU, except for a pooling model on a CPU with AMX-BF16, which gets bfloat16.
    "half" and "float16" are FP16, "bfloat16" is BF16, "float" and "float32" are FP32.
    On CPU, bfloat16 stores the attention and MLP projections in bfloat16 and runs
    their dots in it, accumulated in float32; activations, embeddings, norms, heads
    and the KV cache stay float32 (XLA:CPU's bfloat16 elementwise math is slow)."""
    max_model_len: int | None = spec(None, gt=0, human_readable=True)
    """Model context length (prompt and output). If unspecified, it is derived from
    the model config. The flag accepts human-readable k/m/g/K/M/G: 1k -> 1000,
    1K -> 1024, 25.6k -> 25600."""
    seed: int = 0
    """Random seed for reproducibility."""
    served_model_name: str | list[str] | None = None
    """The model name(s) used in the API. If several names are given, the server
    answers to any of them and reports the first one in responses. If unspecified,
    the name is the same as --model. The first name is also the model_name label of
    the Prometheus metrics."""
    hf_overrides: dict = spec(default_factory=dict)
    """Arguments forwarded to the Hugging Face config, overriding its values.
    Should be a valid JSON string or JSON keys passed individually."""
    generation_config: str = "auto"
    """The folder path to the generation config. "auto" loads the generation config
    from the model path; "vllm" (or "jaxengine") loads none and uses the engine's
    defaults; a folder path loads it from there. A max_new_tokens in the generation
    config caps the number of output tokens of every request."""
    override_generation_config: dict = spec(default_factory=dict)
    """Overrides or sets generation config values, e.g. {"temperature": 0.5}. With
    --generation-config auto the overrides are merged with the model's defaults.
    Should be a valid JSON string or JSON keys passed individually."""
    quantization: QuantizationMethod | None = spec(None, aliases=("-q",))
    """Method used to quantize the weights. If None, the quantization_config of the
    model config is checked first; if that is absent, the weights are assumed
    unquantized and --dtype decides their data type. "int8" and "fp8" quantize the
    attention and MLP weights (and MoE experts) at load time, weight-only with one
    scale per output channel; "gguf" reads a .gguf file (dequantized at load)."""
    skip_tokenizer_init: bool = False
    """Skip initialization of the tokenizer and detokenizer. Inputs must then carry
    prompt_token_ids (prompt None) and outputs carry token ids only."""
    max_logprobs: int = spec(20, ge=-1)
    """Maximum number of log probabilities to return when logprobs is specified in
    SamplingParams. The default is the OpenAI Chat Completions API's. -1 means no
    cap: all (output_length * vocab_size) logprobs may be returned."""
    enforce_eager: bool = False
    """Skip ahead-of-time compilation of the step function for every token/request
    bucket at start-up; shapes are then compiled on first use (jaxengine's
    counterpart of vLLM disabling CUDA graphs)."""
    enable_sleep_mode: bool = False
    """Enable the engine's sleep mode: `LLM.sleep` frees the KV cache and parks the
    weights in host memory (level 1) or drops them (level 2) while a trainer uses the
    devices; `LLM.wake_up` brings them back, with no recompilation."""
    chat_template: str | None = None
    """The chat template to use: a file path or the template itself as a string. If
    unspecified, the tokenizer's (or GGUF file's) template is used."""
    disable_sliding_window: bool = False
    """Whether to disable sliding window. If True, max_model_len is capped at the
    model's sliding window size, so that no sequence outgrows the window and every
    layer attends to the whole context. If the model has no sliding window, this
    argument is ignored."""
    runner: RunnerType = "auto"
    """The model runner: "generate" (text generation) or "pooling" (one pass over each
    prompt, its hidden states pooled into an embedding: `LLM.embed`,
    /v1/embeddings). "auto" picks pooling for encoder and classifier checkpoints
    (BertModel, *ForSequenceClassification) and when --convert asks for a pooling
    task, else generate. "draft" is not supported yet."""
    convert: ConvertType = "auto"
    """Adapt the model to a pooling task: "embed" serves a causal LM as an embedding
    model (its last hidden state after the last token, normalized, unless
    --pooler-config says otherwise); "classify" as a sequence classifier (a score
    head at the last token: the checkpoint's score.weight, or rows of its LM head
    named by classifier_from_token and method in --hf-overrides, as for LLM
    rerankers); "reward" as a reward model (every token's hidden state, not
    normalized: LLM.reward). "auto": embed under --runner pooling for a generative
    checkpoint, classify for a *ForSequenceClassification one, none otherwise."""
    task: TaskOption | None = None
    """Deprecated (vLLM's older flag): use --runner and --convert. "generate" is
    --runner generate; "embed" (or "embedding") --runner pooling --convert embed;
    "classify" and "score" --convert classify; "reward" --convert reward. It cannot
    be combined with --runner or --convert."""
    pooler_config: dict | None = spec(None, aliases=("--override-pooler-config",))
    """How a pooling model pools (JSON): "pooling_type" (LAST, MEAN, CLS or ALL),
    "normalize" (L2, the default for embeddings) and "dimensions" (cut every
    embedding to its first N values, for Matryoshka models). Unset keys come from
    the model's sentence-transformers files (modules.json, 1_Pooling/config.json)
    when it has them, else LAST for a converted causal LM and CLS for an encoder.
    --override-pooler-config is vLLM's deprecated name for it."""
    logprobs_mode: LogprobsMode = "raw_logprobs"
    """What logprobs and prompt_logprobs return. "raw" is before any logits
    processing (temperature, penalties, top-k/top-p); "processed" is after all of
    it; "logits" returns logits instead of log probabilities."""
    logits_processors: list[str | type] | None = None
    """One or more logits processors' fully-qualified class names (pkg.mod:Class or
    pkg.mod.Class) or class definitions. Each must subclass
    jaxengine.logits_processor.LogitsProcessor: it sees every request (a request opts
    in through SamplingParams.extra_args, the server's vllm_xargs) and its apply runs
    in JAX inside the compiled sampler; any other class (vLLM's torch processors) is
    refused at start-up. Not with speculative decoding or a pooling model (as vLLM)."""

    def __post_init__(self) -> None:
        validate_config(self)
        require(bool(self.model), "model", "must not be empty")
        names = self.served_model_name
        if isinstance(names, list):
            require(len(names) > 0, "served_model_name", "must name at least one model")
        if names is not None:
            for name in [names] if isinstance(names, str) else names:
                require(bool(name), "served_model_name", "names must not be empty")
        require(bool(self.generation_config), "generation_config", "must not be empty")
        self._check_pooler_config()
        require(
            self.task in (None, "auto") or (self.runner, self.convert) == ("auto", "auto"),
            "task",
            "(deprecated) cannot be combined with --runner or --convert: use those alone",
        )

    def _check_pooler_config(self) -> None:
        pooler = self.pooler_config or {}
        unknown = sorted(set(pooler) - POOLER_KEYS)
        require(
            not unknown, "pooler_config", f"unknown key(s) {unknown}; known: {sorted(POOLER_KEYS)}"
        )
        kind = pooler.get("pooling_type")
        require(
            kind is None or str(kind).upper() in POOLING_TYPES,
            "pooler_config",
            f"pooling_type {kind!r} is not one of {list(POOLING_TYPES)}",
        )
        dims = pooler.get("dimensions")
        require(
            dims is None or (isinstance(dims, int) and dims >= 1),
            "pooler_config",
            f"dimensions must be an integer >= 1, got {dims!r}",
        )

    @property
    def runner_type(self) -> str:
        """--runner, or the runner the deprecated --task names."""
        if self.task in (None, "auto"):
            return self.runner
        return TASK_RUNNERS[self.task][0]

    @property
    def convert_type(self) -> str:
        """--convert, or the conversion the deprecated --task names."""
        if self.task in (None, "auto"):
            return self.convert
        return TASK_RUNNERS[self.task][1]

    @property
    def served_model_names(self) -> list[str]:
        """The names the server answers to; the first is the reported one."""
        names = self.served_model_name
        if names is None:
            return [self.model]
        return [names] if isinstance(names, str) else list(names)
