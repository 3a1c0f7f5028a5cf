"""Input-wait instrumentation: how long each training step waited for its batch, against the
whole step. The first step after a (re)start is left out: it waits for the loader to start
(opening files, the first window), a one-off cost that says nothing about steady state."""

from __future__ import annotations

import time


class InputTimer:
    def __init__(self) -> None:
        self.wait_s = self.step_s = 0.0
        self._skip = True
        self._start = self._got = 0.0

    def begin_step(self) -> None:
        self._start = time.perf_counter()

    def got_batch(self) -> None:
        self._got = time.perf_counter()

    def end_step(self) -> None:
        """Call once the step's work is issued. The step reads nothing back from the device, so
        on CUDA this is when its kernels are queued (the host runs ahead until the queue is
        full); on CPU the work is done."""
        if self._skip:
            self._skip = False
            return
        self.wait_s += self._got - self._start
        self.step_s += time.perf_counter() - self._start

    def take(self) -> tuple[float, float]:
        """(wait_s, step_s) since the last take."""
        out = (self.wait_s, self.step_s)
        self.wait_s = self.step_s = 0.0
        return out
