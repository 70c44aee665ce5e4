"""Device side of the engine: packing scheduled requests into compiled buckets, the
jitted step (model forward, KV-cache write, logits), and the on-device sampler.

Modules (imported on demand; importing this package pulls in nothing, not even jax):

- `sampling_metadata`: host side, numpy only. Turns each request's `SamplingParams`
  and its tokens so far into the padded per-step arrays the sampler reads, plus the
  static `SamplerFlags` that pick one of a finite set of compiled sampler variants.
- `sampler`: jax. `sample(logits[R, V], metadata, flags=...)` applies allowed-token
  masks, biases and bans, penalties, temperature, min-p, top-k and top-p, draws each
  row with its own key, and returns token ids and requested logprobs;
  `prompt_logprobs()` scores prompt tokens.
- `logits_processors`: host side, numpy only. `ProcessorBatch`: the engine's custom
  logits processors (``--logits-processors``), the batch updates they see each step
  and their fixed-shape states, which `sample` hands to their traced ``apply``.
"""
