"""Speculative decoding on the device: the proposers that run a model of their own
(a draft model, an EAGLE head) in the target's pages, their loading, and the
builder the worker calls (`device.build`). Imports the runner; the runner never
imports this folder."""
