"""Coalesced rewrites of a whole file (the trial table and, with it, the study's index row).

Rewriting a table of n rows after each of a study's trial events costs O(n) each time, so
O(n^2) over the study (what it cost: docs/performance.md). An object store also limits how
often one object may be rewritten (GCS: once per second per object name). So a change *requests* a write; it
runs at once if the last write is long enough ago, else once when the wait ends, for every
change requested meanwhile. The wait after a write is the longer of `min_interval_s` and what
keeps writing to `share` of the time (9x the write's duration at share 0.1): however large the
table grows, rewriting it takes a bounded share of the coordinator's time, and the rows written
over a study grow linearly with its trials (bench/scale.py, tests/unit/test_trial_table_writes.py).

What a crash can lose: the changes of the last wait (about a second). The trial table's
readers tolerate it: a trial whose FINISHED row was not written is started again on resume and
resumes from its latest checkpoint.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

SHARE = 0.1
MIN_INTERVAL_S = 1.0


class Coalesced:
    Timer = threading.Timer
    """What runs a deferred write (swappable: tests fire it by hand)."""

    def __init__(
        self,
        write: Callable[[], None],
        share: float = SHARE,
        min_interval_s: float = MIN_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1] (got {share})")
        self._write, self.share, self.min_interval_s, self.clock = write, share, min_interval_s, clock
        self._state = threading.Lock()  # guards the three fields below
        self._pending = False  # a change was requested that no write has started to include
        self._next_s = -math.inf  # when the next write may start
        self._timer = None
        self._writing = threading.Lock()  # one write at a time

    def request(self) -> None:
        """Something changed: write now, or at the end of the current wait."""
        with self._state:
            self._pending = True
            if self._timer is not None:
                return  # the scheduled write will include this change
            delay = self._next_s - self.clock()
            if delay > 0:
                self._schedule(delay)
                return
        self._write_pending()

    def flush(self) -> None:
        """Write now, including every change so far (the end of a round or of a study)."""
        with self._state:
            self._pending = True
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        self._write_pending()

    def _schedule(self, delay_s: float) -> None:  # with self._state held
        self._timer = self.Timer(delay_s, self._on_timer)
        self._timer.daemon = True
        self._timer.start()

    def _on_timer(self) -> None:
        with self._state:
            self._timer = None
        try:
            self._write_pending()
        except Exception as e:  # noqa: BLE001 - retried after the next wait; the caller is gone
            print(f"warning: deferred write failed, retrying: {type(e).__name__}: {e}", flush=True)

    def _write_pending(self) -> None:
        with self._writing:
            with self._state:
                if not self._pending:
                    return  # a write that started after the request already included it
                self._pending = False
            start = self.clock()
            try:
                self._write()  # reads the state to write after clearing _pending
            except BaseException:
                with self._state:
                    self._pending = True  # not written: the next request or flush retries
                raise
            finally:
                end = self.clock()
                with self._state:
                    wait = max(self.min_interval_s, (end - start) * (1 - self.share) / self.share)
                    self._next_s = end + wait
                    if self._pending and self._timer is None:  # changed while this write ran
                        self._schedule(wait)
