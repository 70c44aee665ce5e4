"""Structured outputs: grammars that constrain sampling through a token bitmask.

Host side, no jax. `StructuredOutputManager` owns one grammar matcher per request
(compiled off the engine loop, cached by constraint); the scheduler asks it which
waiting requests are ready, and for the bitmask rows of the requests that sample in a
step (`SchedulerOutput.grammar_bitmask`); the runner hands the rows to the compiled
sampler, which masks the logits on device; `Scheduler.update` feeds each sampled token
back. `guidance.py` is the llguidance backend.
"""

from jaxengine.structured_output.backend import Grammar, GrammarBackend, bitmask_width
from jaxengine.structured_output.manager import StructuredOutputManager, make_manager

__all__ = [
    "Grammar",
    "GrammarBackend",
    "StructuredOutputManager",
    "bitmask_width",
    "make_manager",
]
