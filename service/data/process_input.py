"""Local input worker processes (`input.workers: processes`): what torch's DataLoader
`num_workers` is for the streaming loader. Online preprocessing written as a Python loop holds
the GIL, so a prefetch thread cannot run it beside the step (the step needs the GIL too);
worker processes can.

The rank still plans its own windows (`TrainStream.plan`) and cuts them into batches; only
the work of a window -- reading its row groups, the workload's `to_batch` and the window's
shuffle (`TrainStream.load`) -- runs in a pool of `input.num_input_workers` processes. Windows
are submitted in plan order, one more than there are workers, and taken back in that order,
so every batch is the in-thread loader's bit for bit and a resumed run continues the same
sequence. A rank then holds at most `num_workers` + 2 windows (in flight, ready, being served).
Reading and preprocessing time is spent in the workers: the rank's `input/read_s` and
`input/preprocess_s` stay near zero, its `input/wait_s` is what remains exposed.

Workers start from a fork server (never a fork of the trainer, whose threads and accelerator
state a child must not inherit) that has this module, and so torch and pyarrow, imported.
"""

from __future__ import annotations

import itertools
import multiprocessing
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np
import torch

from service.core.errors import DataError
from service.data.loader import Batch, TrainStream, WindowReader, WindowTask, rebatch

_worker: tuple[TrainStream, WindowReader] | None = None
"""In a worker process: the rank's stream and the worker's reader."""


class InputWorkerDied(RuntimeError):
    """An input worker process ended while it loaded a window (killed from outside, out of
    memory). Not the data's fault, so not a DataError: the trial is retried from its latest
    checkpoint, as after the loss of any of its processes."""


def process_source(num_workers: int) -> Callable[[TrainStream, int], Iterator[Batch]]:
    """A `loop.BatchSource` whose windows are loaded by `num_workers` local processes."""

    def source(stream: TrainStream, start_step: int) -> Iterator[Batch]:
        chunks = _windows(stream, stream.plan(start_step * stream.batch_size), num_workers)
        return rebatch(chunks, stream.batch_size, keep_last=False)

    return source


def _windows(stream: TrainStream, plan: Iterator[WindowTask], num_workers: int) -> Iterator[Batch]:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    pool = ProcessPoolExecutor(num_workers, context, initializer=_start_worker, initargs=(stream,))
    try:
        pending = deque((task, pool.submit(_load, task)) for task in itertools.islice(plan, num_workers + 1))
        while True:
            task, future = pending.popleft()
            nxt = next(plan)  # submitted before waiting, so that no worker idles meanwhile
            pending.append((nxt, pool.submit(_load, nxt)))
            try:
                arrays = future.result()
            except DataError:
                raise
            except BrokenProcessPool as e:
                raise InputWorkerDied(f"an input worker process died while it loaded a window ({e})") from e
            except Exception as e:  # noqa: BLE001 - named with the window's files, cause kept
                files = ", ".join(sorted({p.uri for p in task.pieces}))
                error = f"{type(e).__name__}: {e}"
                raise DataError(f"{files}: an input worker failed on this window ({error})") from e
            yield {k: torch.from_numpy(v) for k, v in arrays.items()}
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _start_worker(stream: TrainStream) -> None:
    global _worker
    # The workers share the host's cores with the step: one intra-op thread each, as
    # DataLoader's workers have.
    torch.set_num_threads(1)
    _worker = (stream, WindowReader(stream.workload))


def _load(task: WindowTask) -> dict[str, np.ndarray]:
    """One window, shuffled, as arrays (pickled through the pool's pipe by value)."""
    stream, reader = _worker
    return {k: v.numpy() for k, v in stream.load(task, reader).items()}
