"""Background prefetch: a thread prepares the next batches while the step runs, so reading and
preprocessing overlap with compute (the playbook: prefetch). Depth 0 is no thread at all (the
step waits for every batch; what `input/exposed_fraction` measures).

The thread hands over *runs* of consecutive items (the training stream: all the batches of one
shuffle window) rather than one item at a time: a hand-off wakes the other thread, and one
per window instead of one per batch keeps that cost off the step.

On a CPU trial the thread ends once the training stream's shard is in memory (`LoaderStats.
in_memory`: a batch is then an index into tensors, read and converted once) and the step
gathers each batch itself. A Python thread running beside the step takes the GIL each time a
torch operation of the step lets go of it, and the step then waits to take it back: on CPU
those hand-offs cost more than the gather they would hide, and the gather would take the
cores the step's operations use anyway. On CUDA the thread stays (it pins each batch)."""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
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
    prefetcher is garbage collected (a finished or failed loop just drops it).

    `handover`, asked after each run: once it is true, the thread ends and the consumer
    computes the later runs itself (after the items already ready), in the same order."""

    def __init__(self, runs: Iterator[list[T]], depth: int, handover: Callable[[], bool] | None = None):
        assert depth > 0
        self._depth = depth
        self._direct: Iterator[T] | None = None  # the runs, once the thread handed them over
        self._ready: deque = deque()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        # The thread holds the source, deque and events, never `self`: dropping the prefetcher
        # runs the finalizer, which stops the thread.
        self._thread = threading.Thread(
            target=_fill,
            args=(runs, depth, self._ready, self._cond, self._stop, handover),
            name="playbook-prefetch",
            daemon=True,
        )
        self._thread.start()
        # Also at interpreter exit: a daemon thread inside a parquet read while the interpreter
        # finalizes can abort the process.
        self._finalizer = weakref.finalize(self, _stop, self._cond, self._stop, self._thread, self._ready)

    def __next__(self) -> T:
        if self._direct is None:
            item = self._next_ready()
            if not isinstance(item, _Handover):
                return item
            self._direct = itertools.chain.from_iterable(item.runs)
        try:
            return next(self._direct)
        except StopIteration:
            raise
        except BaseException as e:  # raised again on every later next(), as the thread's are
            self._direct = None
            with self._cond:
                self._ready[0] = _Failure(e)  # in place of the handover: its source has ended
            raise

    def _next_ready(self):
        """The next ready item (taken from the queue), or the handover (left in it, where
        `close()` finds its source)."""
        with self._cond:
            while not self._ready:
                self._cond.wait()
            item = self._ready[0]
            if item is _END:
                raise StopIteration
            if isinstance(item, _Failure):
                raise item.error
            if isinstance(item, _Handover):
                return item
            self._ready.popleft()
            if len(self._ready) < self._depth:
                # Only now is there room the thread waits for: a wake-up on every item would
                # switch to the thread (and back) each step only for it to wait again.
                self._cond.notify()
            return item

    def close(self) -> None:
        self._finalizer()


class _Handover:
    """The source, handed to the consumer after the ready items (the thread has ended)."""

    def __init__(self, runs: Iterator[list]):
        self.runs = runs


def _close(source) -> None:
    close = getattr(source, "close", None)
    if close:
        close()


class _Failure:
    """The source's error, kept at the end of the ready items (raised on every later next())."""

    def __init__(self, error: BaseException):
        self.error = error


def _stop(cond: threading.Condition, stop: threading.Event, thread: threading.Thread, ready: deque) -> None:
    stop.set()
    with cond:
        cond.notify_all()
    if thread is not threading.current_thread():
        thread.join(timeout=10)
    with cond:
        handed = [item for item in ready if isinstance(item, _Handover)]
    for item in handed:
        _close(item.runs)


def _fill(runs: Iterator[list], depth: int, ready: deque, cond: threading.Condition, stop, handover) -> None:
    end: object = _END
    try:
        for run in runs:  # computed outside the lock: the consumer serves what is ready meanwhile
            if handover is not None and handover() and not stop.is_set():
                end = _Handover(runs)
                with cond:
                    ready.extend(run)
                break
            with cond:
                ready.extend(run)
                cond.notify_all()
                while len(ready) >= depth and not stop.is_set():
                    cond.wait()
            if stop.is_set():
                break  # the end follows the ready items: a later next() ends rather than waits
    except BaseException as e:  # noqa: BLE001 - handed to the consumer
        end = _Failure(e)
    finally:
        if not isinstance(end, _Handover):
            _close(runs)
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
        _close(source)


def prefetch_stream(stream: TrainStream, start_step: int, depth: int, pin: bool = False) -> Iterator[Batch]:
    """The training batches of `start_step` on, prepared a shuffle window at a time on a
    background thread that starts on the next window once fewer than `depth` batches are
    ready (depth 0: no thread; the step loads each window itself). With `pin` (and CUDA
    available), the thread also copies each batch into page-locked memory, so the step's
    `.to(device, non_blocking=True)` is an asynchronous copy rather than a host-blocking one.
    Without it, the thread ends once the shard is in memory (see the module docstring)."""
    if depth == 0:
        return stream.iterate(start_step)
    runs = stream.runs(start_step)
    if pin and torch.cuda.is_available():
        return Prefetcher(_pinned(runs), depth)
    stats = stream.stats
    return Prefetcher(runs, depth, handover=lambda: stats.in_memory)


def _pinned(runs: Iterator[list[Batch]]) -> Iterator[list[Batch]]:
    try:
        for run in runs:
            yield [{k: v.pin_memory() for k, v in batch.items()} for batch in run]
    finally:
        _close(runs)
