"""The worker: what one device process builds and owns.

`build.build_worker(config, devices)` loads the model (`loading`: one replica's
model, JAX or the torch fallback, and its stage program), resolves what only the
model can tell (``max_model_len``, the EOS token, the generation config, the pooler:
`pooling`), sizes the KV cache, and composes the `ModelRunner` with its speculative
proposer (`speculative.device.build`) and adapter slots. Every executor
(`jaxengine.executor`) builds its runners here: locally, on each host of a
multi-host engine, in each Ray worker.
"""
