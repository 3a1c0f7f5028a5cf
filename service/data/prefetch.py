"""Background prefetch: a thread fills a bounded queue with the next batches while the step
runs, so reading and preprocessing overlap with compute (the playbook: prefetch). Depth 0 is
no thread at all (the step waits for every batch; what `input/exposed_fraction` measures)."""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")
_END = object()


class Prefetcher(Iterator[T]):
    """Iterates `source` on a daemon thread, at most `depth` items ahead. Errors of the source
    are raised in the consumer, at the item where they happened. The thread stops at `close()`
    or when the prefetcher is garbage collected (a finished or failed loop just drops it)."""

    def __init__(self, source: Iterator[T], depth: int):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        # The thread holds the source, queue and event, never `self`: dropping the prefetcher
        # runs the finalizer, which stops the thread.
        self._thread = threading.Thread(
            target=_fill, args=(source, self._queue, self._stop), name="playbook-prefetch", daemon=True
        )
        self._thread.start()
        # Also at interpreter exit: a daemon thread inside a parquet read while the interpreter
        # finalizes can abort the process.
        self._finalizer = weakref.finalize(self, _stop, self._stop, self._thread)

    def __next__(self) -> T:
        item = self._queue.get()
        if item is _END:
            self._queue.put(_END)
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._finalizer()


def _stop(stop: threading.Event, thread: threading.Thread) -> None:
    stop.set()
    if thread is not threading.current_thread():
        thread.join(timeout=10)


def _fill(source: Iterator, q: queue.Queue, stop: threading.Event) -> None:
    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    try:
        for item in source:
            if not put(item):
                return
        put(_END)
    except BaseException as e:  # noqa: BLE001 - handed to the consumer
        put(e)
    finally:
        close = getattr(source, "close", None)
        if close:
            close()


def prefetch(source: Iterator[T], depth: int) -> Iterator[T]:
    """`source` prefetched `depth` items ahead on a background thread (depth 0: `source`)."""
    return Prefetcher(source, depth) if depth > 0 else source
