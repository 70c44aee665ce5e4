"""Pausing an async engine's generation (vLLM's ``pause_generation`` modes).

An RL trainer pauses its rollout server before it changes the weights: the engine
thread stops stepping, and new requests wait until `resume_generation`. What happens
to the unfinished ones is the mode's:

- ``abort``: they end now, each stream with its last output (finish reason
  ``abort``);
- ``wait``: they run to the end first; the pause takes effect (and the caller's
  future resolves) once none is left;
- ``keep``: they stay in the scheduler with their KV pages, held, and go on after
  the resume (with the new weights, if the weights changed meanwhile).

`PauseState` is the engine thread's bookkeeping; it lives on that thread only. The
engine's `RolloutControl.paused` follows it, so a weight update is allowed while
requests are held.
"""

from __future__ import annotations

from typing import Any

PAUSE_MODES = ("abort", "wait", "keep")


class PauseState:
    """Whether generation is paused, the requests that arrived meanwhile, and a
    ``wait`` pause's caller until the engine drains."""

    def __init__(self) -> None:
        self.paused = False
        self.held: list[Any] = []  # adds that arrived while paused or draining
        self.waiting: Any = None  # the ``wait`` pause command until drained

    def hold(self, add: Any) -> bool:
        """Keeps ``add`` for the resume while paused or draining; True if kept."""
        if self.paused or self.waiting is not None:
            self.held.append(add)
            return True
        return False

    def begin(self, command: Any, engine: Any) -> None:
        """Starts a pause: now (``abort``, ``keep``), or once drained (``wait``)."""
        if command.mode == "wait":
            self.waiting = command
            self.drained(engine)
            return
        self._set(engine, True)
        command.done.set_result(None)

    def drained(self, engine: Any) -> None:
        """Completes a ``wait`` pause when no request is left."""
        if self.waiting is not None and not engine.has_unfinished_requests():
            command, self.waiting = self.waiting, None
            self._set(engine, True)
            command.done.set_result(None)

    def end(self, engine: Any) -> list[Any]:
        """Resumes; returns the held adds to queue now (a ``wait`` still draining is
        answered as paused first)."""
        if self.waiting is not None:
            command, self.waiting = self.waiting, None
            command.done.set_result(None)
        self._set(engine, False)
        held, self.held = self.held, []
        return held

    def _set(self, engine: Any, paused: bool) -> None:
        self.paused = paused
        engine.rollout.paused = paused
