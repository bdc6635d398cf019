"""StepGate: a fault drill's hold on a worker's engine loop (`TargetWorker.allow_steps`).

A drill that acts while a reply is still being generated (killing the draft mid-stream)
cannot rely on the reply being slow: it lets the engine run a given number of steps, acts
while the loop waits at the gate, then lifts the limit. Open (no limit) unless a drill sets one.
"""

from __future__ import annotations

import threading


class StepGate:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._left: int | None = None  # steps still allowed; None: no limit

    def allow(self, steps: int | None) -> None:
        """From now on let `steps` more steps run (None: any number)."""
        with self._cond:
            self._left = steps
            self._cond.notify_all()

    def pass_through(self) -> None:
        """Called on the engine thread before each step: waits while no step is allowed."""
        with self._cond:
            self._cond.wait_for(lambda: self._left != 0)
            if self._left is not None:
                self._left -= 1
