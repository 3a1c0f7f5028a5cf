"""Rows to batches: a chunk's rows served in order or in a shuffled order (`Rows`, `Shuffled`),
and chunks of any size cut into batches of exactly the batch size (`rebatch`)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

Batch = dict[str, torch.Tensor]
_from_numpy = torch.from_numpy


class Rows:
    """A chunk's rows, served in order (`take(lo, hi)`: rows lo..hi-1, as views)."""

    def __init__(self, tensors: Batch):
        self.tensors = tensors

    def __len__(self) -> int:
        return len(next(iter(self.tensors.values())))

    def take(self, lo: int, hi: int) -> Batch:
        return {k: v[lo:hi] for k, v in self.tensors.items()}


class Shuffled(Rows):
    """A window's rows in the order `order` (`take(lo, hi)`: the rows order[lo:hi]), gathered
    a batch at a time: each batch owns small tensors from memory the allocator reuses, where a
    shuffled copy of the whole window would take fresh pages every window."""

    def __init__(self, tensors: Batch, order: np.ndarray):
        super().__init__(tensors)
        self.order = order
        self.arrays = {k: _numpy_view(v) for k, v in tensors.items()}
        self.views = None if any(a is None for a in self.arrays.values()) else list(self.arrays.items())
        """(name, numpy view) of each tensor when numpy has all their dtypes: a batch is then a
        numpy `take` per tensor and nothing else (this runs once per batch)."""

    def __len__(self) -> int:
        return len(self.order)

    def take(self, lo: int, hi: int) -> Batch:
        rows = self.order[lo:hi]
        if self.views is not None:
            return {k: _from_numpy(a.take(rows, 0)) for k, a in self.views}
        return {k: _gather(v, self.arrays[k], rows) for k, v in self.tensors.items()}


def _numpy_view(v: torch.Tensor) -> np.ndarray | None:
    """The tensor's memory as a numpy array, or None where numpy has no such dtype (bfloat16)."""
    try:
        return v.numpy()
    except (TypeError, RuntimeError):
        return None


def _gather(v: torch.Tensor, array: np.ndarray | None, rows: np.ndarray) -> torch.Tensor:
    """Rows `rows` of `v` (numpy's take on whole rows is the cheapest gather per call)."""
    if array is None:
        return v.index_select(0, torch.from_numpy(rows))
    return torch.from_numpy(array.take(rows, axis=0))


def rebatch(chunks: Iterator[Batch | Rows], batch_size: int, keep_last: bool) -> Iterator[Batch]:
    """Chunks of any size -> batches of exactly `batch_size` rows (and a short last one when
    `keep_last`), without a per-example loop."""
    for run in rebatch_runs(chunks, batch_size, keep_last):
        yield from run


def rebatch_runs(chunks: Iterator[Batch | Rows], batch_size: int, keep_last: bool) -> Iterator[list[Batch]]:
    """`rebatch`, as one list per chunk of the batches that chunk completes. A chunk is dropped
    before the next one is drawn: a window's tensors are freed before the next window's are
    made, so that the allocator reuses their memory."""
    carry: Batch | None = None
    for chunk in chunks:
        run, carry = _cut(chunk if isinstance(chunk, Rows) else Rows(chunk), carry, batch_size)
        del chunk
        if run:
            yield run
    if keep_last and carry is not None:
        yield [carry]


def _cut(rows: Rows, carry: Batch | None, batch_size: int) -> tuple[list[Batch], Batch | None]:
    """The batches that `rows` complete (the carried rows of the chunk before first), and the
    rows left over."""
    n, run, start = len(rows), [], 0
    if carry is not None:
        # Only the rows that complete the carried batch are copied, not the whole chunk.
        start = min(n, batch_size - len(carry["label"]))
        carry = {k: torch.cat([carry[k], v]) for k, v in rows.take(0, start).items()}
        if len(carry["label"]) < batch_size:  # a chunk shorter than the gap
            return run, carry
        run.append(carry)
    full = start + (n - start) // batch_size * batch_size
    run += [rows.take(s, s + batch_size) for s in range(start, full, batch_size)]
    return run, (rows.take(full, n) if full < n else None)
