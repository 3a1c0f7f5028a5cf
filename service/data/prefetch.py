"""Background prefetch: a thread prepares the next batches while the step runs, so reading and
preprocessing overlap with compute (the playbook: prefetch). Depth 0 is no thread at all (the
step waits for every batch; what `input/exposed_fraction` measures).

The thread hands over *runs* of consecutive items (the training stream: all the batches of one
shuffle window) rather than one item at a time: a hand-off wakes the other thread, and one
per window instead of one per batch keeps that cost off the step."""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:
    from service.data.loader import Batch, TrainStream

T = TypeVar("T")
_END = object()


class Prefetcher(Iterator[T]):
    """Serves the items of `runs` (lists of consecutive items) in order, computing them on a
    daemon thread that starts on the next run whenever fewer than `depth` items are ready (so
    at most `depth` - 1 items plus one run are ahead). Errors of the source are raised in the
    consumer, after the items before them. The thread stops at `close()` or when the
    prefetcher is garbage collected (a finished or failed loop just drops it)."""

    def __init__(self, runs: Iterator[list[T]], depth: int):
        assert depth > 0
        self._depth = depth
        self._ready: deque = deque()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        # The thread holds the source, deque and events, never `self`: dropping the prefetcher
        # runs the finalizer, which stops the thread.
        self._thread = threading.Thread(
            target=_fill,
            args=(runs, depth, self._ready, self._cond, self._stop),
            name="playbook-prefetch",
            daemon=True,
        )
        self._thread.start()
        # Also at interpreter exit: a daemon thread inside a parquet read while the interpreter
        # finalizes can abort the process.
        self._finalizer = weakref.finalize(self, _stop, self._cond, self._stop, self._thread)

    def __next__(self) -> T:
        with self._cond:
            while not self._ready:
                self._cond.wait()
            item = self._ready[0]
            if item is _END:
                raise StopIteration
            if isinstance(item, _Failure):
                raise item.error
            self._ready.popleft()
            if len(self._ready) < self._depth:
                # Only now is there room the thread waits for: a wake-up on every item would
                # switch to the thread (and back) each step only for it to wait again.
                self._cond.notify()
            return item

    def close(self) -> None:
        self._finalizer()


class _Failure:
    """The source's error, kept at the end of the ready items (raised on every later next())."""

    def __init__(self, error: BaseException):
        self.error = error


def _stop(cond: threading.Condition, stop: threading.Event, thread: threading.Thread) -> None:
    stop.set()
    with cond:
        cond.notify_all()
    if thread is not threading.current_thread():
        thread.join(timeout=10)


def _fill(runs: Iterator[list], depth: int, ready: deque, cond: threading.Condition, stop) -> None:
    end: object = _END
    try:
        for run in runs:  # computed outside the lock: the consumer serves what is ready meanwhile
            with cond:
                ready.extend(run)
                cond.notify_all()
                while len(ready) >= depth and not stop.is_set():
                    cond.wait()
            if stop.is_set():
                return
    except BaseException as e:  # noqa: BLE001 - handed to the consumer
        end = _Failure(e)
    finally:
        close = getattr(runs, "close", None)
        if close:
            close()
    with cond:
        ready.append(end)
        cond.notify_all()


def prefetch(source: Iterator[T], depth: int) -> Iterator[T]:
    """`source` prefetched `depth` items ahead on a background thread (depth 0: `source`)."""
    return Prefetcher(_singletons(source), depth) if depth > 0 else source


def _singletons(source: Iterator[T]) -> Iterator[list[T]]:
    try:
        for item in source:
            yield [item]
    finally:
        close = getattr(source, "close", None)
        if close:
            close()


def prefetch_stream(stream: TrainStream, start_step: int, depth: int, pin: bool = False) -> Iterator[Batch]:
    """The training batches of `start_step` on, prepared a shuffle window at a time on a
    background thread that starts on the next window once fewer than `depth` batches are
    ready (depth 0: no thread; the step loads each window itself). With `pin` (and CUDA
    available), the thread also copies each batch into page-locked memory, so the step's
    `.to(device, non_blocking=True)` is an asynchronous copy rather than a host-blocking one."""
    if depth == 0:
        return stream.iterate(start_step)
    runs = stream.runs(start_step)
    return Prefetcher(_pinned(runs) if pin and torch.cuda.is_available() else runs, depth)


def _pinned(runs: Iterator[list[Batch]]) -> Iterator[list[Batch]]:
    try:
        for run in runs:
            yield [{k: v.pin_memory() for k, v in batch.items()} for batch in run]
    finally:
        close = getattr(runs, "close", None)
        if close:
            close()
