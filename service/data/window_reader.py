"""Reading a rank's rows: its row ranges cut into pieces (a row group, or the part of one that
belongs to the rank), the pieces of a window read on threads (one window read ahead while the
one before is consumed), and the workload's `to_batch` of a window's rows, whose failure names
the file, column and row it fails on."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from service.core.errors import DataError
from service.data.batches import Batch
from service.data.files import ParquetReader
from service.data.sharding import RowRange
from service.workloads.base import Workload

READ_THREADS = os.cpu_count() or 1
"""Row groups of a window read at once: one per core (each read holds its decode buffers). One
core fewer, left to the thread turning the window before into batches, spends less CPU per
example but was slower on 2 cores (docs/performance.md)."""


@dataclass(frozen=True)
class Piece:
    """Rows [lo, hi) of row group `row_group` of `uri` (a rank's share of one row group), and
    their share of the row group's uncompressed bytes of the columns read."""

    uri: str
    row_group: int
    lo: int
    hi: int
    num_bytes: int = 0

    @property
    def num_rows(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class WindowTask:
    """Window `window` of epoch `epoch`: its pieces, and the first row of it still to serve."""

    epoch: int
    window: int
    pieces: tuple[Piece, ...]
    offset: int


@dataclass
class LoaderStats:
    """Seconds the producing side spent, summed since the last `take()`: reading row groups
    (I/O and decode), the workload's `to_batch` (online preprocessing) and its `augment` (the
    training stream's online augmentation); and whether the shard is in memory as tensors, or
    will be at the next window (`CachedShard`: each window an index into them, no read, no
    `to_batch`)."""

    read_s: float = 0.0
    preprocess_s: float = 0.0
    augment_s: float = 0.0
    in_memory: bool = False

    def take(self) -> tuple[float, float, float]:
        out = (self.read_s, self.preprocess_s, self.augment_s)
        self.read_s = self.preprocess_s = self.augment_s = 0.0
        return out


def pieces_of(ranges: list[RowRange], reader: ParquetReader) -> list[Piece]:
    """The row ranges cut at row-group boundaries (footers only)."""
    out = []
    for r in ranges:
        offset, uri = 0, r.file.uri
        sizes = zip(reader.row_group_sizes(uri), reader.row_group_bytes(uri), strict=True)
        for i, (n, size) in enumerate(sizes):
            lo, hi = max(r.start, offset), min(r.stop, offset + n)
            if lo < hi:
                out.append(Piece(uri, i, lo - offset, hi - offset, size * (hi - lo) // n))
            offset += n
    return out


class WindowReader:
    """Reads pieces into tensors: projection at read time, `to_batch` once per window."""

    def __init__(self, workload: Workload, stats: LoaderStats | None = None, cache_bytes: int = 0):
        self.workload = workload
        self.reader = ParquetReader(workload.columns, workload)
        self.stats = stats or LoaderStats()
        self._pool: ThreadPoolExecutor | None = None
        # Piece -> its rows as read, reused by later epochs (tf.data's `cache()`), while all of
        # them fit in `cache_bytes` (the Arrow buffers they hold). The first piece that would
        # overflow it drops the cache for good: the shard is streamed every epoch instead (a
        # partial cache read in a new shuffled order each epoch would mostly miss).
        self.cache: dict[Piece, pa.Table] | None = {} if cache_bytes > 0 else None
        self.cache_free = cache_bytes
        self._cache_lock = threading.Lock()
        self.shard: CachedShard | None = None
        """The whole shard's tensors, once made from the cache (`cached_shard`, `shard_of`)."""

    def _cached_read(self, p: Piece, threads: bool = False) -> pa.Table:
        cache = self.cache
        table = cache.get(p) if cache is not None else None
        if table is not None:
            return table
        table = self.reader.read_row_group(p.uri, p.row_group, threads).slice(p.lo, p.num_rows)
        with self._cache_lock:
            if self.cache is not None:
                self.cache_free -= table.get_total_buffer_size()  # a slice holds its row group
                if self.cache_free >= 0:
                    self.cache[p] = table
                else:
                    self.cache = None
        return table

    def cached_shard(self, pieces: list[Piece]) -> CachedShard | None:
        """Once every one of `pieces` (the shard's, in shard order) is in the cache: their rows
        turned into tensors once, in that order (`CachedShard`), which replace the cache (the
        rows are kept once; later calls return them: `shard`). None until then, and when the
        shard does not fit the cache."""
        if self.shard is not None:
            return self.shard
        cache = self.cache  # once: a reading thread may drop the cache meanwhile
        if cache is None or any(p not in cache for p in pieces):
            return None
        table = pa.concat_tables([cache[p] for p in pieces])
        return self.shard_of(self.to_batch(table, pieces), pieces)

    def shard_of(self, tensors: Batch, pieces: list[Piece]) -> CachedShard:
        """`tensors`, the rows of every piece of the shard (in the order of `pieces`), kept as
        the shard's (`CachedShard`) in place of the cache."""
        with self._cache_lock:
            self.cache = None
        self.shard = CachedShard(tensors, pieces)
        return self.shard

    def caches(self, pieces: list[Piece]) -> bool:
        """Whether every one of `pieces` is in the cache."""
        cache = self.cache
        return cache is not None and all(p in cache for p in pieces)

    def read(self, pieces: list[Piece]) -> Batch:
        t0 = time.perf_counter()
        table = self.read_table(pieces)
        self.stats.read_s += time.perf_counter() - t0
        return self.to_batch(table, pieces)

    def start(self, pieces: tuple[Piece, ...]) -> list[Future]:
        """Start reading the pieces on the reader's threads (a window read ahead, while the
        caller works on the one before); `finish` takes their rows. A piece in the cache is
        not sent to a thread: its future is done already."""
        return [self._started(p) for p in pieces]

    def _started(self, p: Piece) -> Future:
        cache = self.cache  # once: a reading thread may drop the cache meanwhile
        table = cache.get(p) if cache is not None else None
        if table is None:
            return self._threads().submit(_timed, self._cached_read, p)
        done: Future = Future()
        now = time.perf_counter()
        done.set_result((table, now, now))
        return done

    def finish(self, started: list[Future]) -> pa.Table:
        """The rows of a started window, in piece order (waits for its reads). Its read time
        is the span from its first read's start to its last read's end."""
        timed = [f.result() for f in started]
        self.stats.read_s += max(t[2] for t in timed) - min(t[1] for t in timed)
        tables = [t[0] for t in timed]
        return tables[0] if len(tables) == 1 else pa.concat_tables(tables)

    def to_batch(self, table: pa.Table, pieces: list[Piece]) -> Batch:
        """The workload's tensors of a window's rows, with their `example_id`."""
        t0 = time.perf_counter()
        try:
            tensors = self.workload.to_batch(table)
        except (pa.ArrowException, ValueError, TypeError) as e:
            raise DataError(self.where_to_batch_fails(table, pieces, e)) from None
        tensors["example_id"] = example_ids(table, self.workload, pieces[0].uri)
        self.check_labels(tensors["label"], pieces)
        self.stats.preprocess_s += time.perf_counter() - t0
        return tensors

    def check_labels(self, label: torch.Tensor, pieces: list[Piece]) -> None:
        """A classifier's integer labels are its classes, 0 to num_classes - 1: another value is a
        data error naming the file, the label column and the row (not an error of the loss)."""
        n = self.workload.num_classes
        if not n or label.dim() != 1 or not len(label) or label.dtype.is_floating_point:
            return
        if label.dtype == torch.bool:
            return
        labels = label.numpy()  # in numpy, as the rest of the per-window work
        if labels.min() >= 0 and labels.max() < n:  # the row is looked for on failure only
            return
        row = int(np.flatnonzero((labels < 0) | (labels >= n))[0])
        p, file_row = self.file_row(pieces, row)
        raise DataError(
            f"{p.uri}: column {self.workload.label_column!r}, row {file_row}: label {int(label[row])} "
            f"is not a class of workload {self.workload.name} (num_classes {n}: 0 to {n - 1})"
        )

    def file_row(self, pieces: list[Piece], row: int) -> tuple[Piece, int]:
        """The piece holding row `row` of the pieces' rows (in piece order), and that row's
        number in its file (counted from 0)."""
        for p in pieces:
            if row < p.num_rows:
                break
            row -= p.num_rows
        return p, sum(self.reader.row_group_sizes(p.uri)[: p.row_group]) + p.lo + row

    def where_to_batch_fails(self, table: pa.Table, pieces: list[Piece], error: Exception) -> str:
        """The error of `to_batch` on a window's rows, naming the file, the column and the row
        in the file (counted from 0) of the first value it fails on (`first_bad_row`,
        `bad_column`)."""
        w = self.workload
        reason = f"workload {w.name} cannot turn it into a batch ({str(error).splitlines()[0]})"
        row = first_bad_row(w, table)
        if row is None:
            return f"{pieces[0].uri}: {reason}"
        p, file_row = self.file_row(pieces, row)
        column = bad_column(w, table, row)
        return f"{p.uri}: " + (f"column {column!r}, " if column else "") + f"row {file_row}: {reason}"

    def read_table(self, pieces: list[Piece]) -> pa.Table:
        """The pieces' rows, in piece order. The row groups of a window are read on threads at
        once: pyarrow decodes without the GIL, so a window decodes on several cores (as one
        `pq.read_table` of the files would)."""

        if len(pieces) == 1:  # decoded on Arrow's threads
            return self._cached_read(pieces[0], threads=True)
        return pa.concat_tables(list(self._threads().map(self._cached_read, pieces)))

    def _threads(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(READ_THREADS, "playbook-read")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)  # a window read ahead is dropped
            self._pool = None


class CachedShard:
    """A cached shard's tensors, made once: a window of it is its pieces' rows picked out by
    index (no read, no `to_batch`, no copy of the window), the same rows in the same order as
    the window's own tensors would hold them."""

    def __init__(self, tensors: Batch, pieces: list[Piece]):
        self.tensors = tensors
        starts = np.cumsum([0] + [p.num_rows for p in pieces[:-1]])
        self.first_row = dict(zip(pieces, starts.tolist(), strict=True))

    def rows(self, pieces: tuple[Piece, ...]) -> np.ndarray:
        """The shard rows of `pieces`, in piece order: a window's rows before its shuffle."""
        return np.concatenate([np.arange(self.first_row[p], self.first_row[p] + p.num_rows) for p in pieces])


def _timed(read: Callable[[Piece], pa.Table], piece: Piece) -> tuple[pa.Table, float, float]:
    start = time.perf_counter()
    table = read(piece)
    return table, start, time.perf_counter()


def _converts(workload: Workload, table: pa.Table) -> bool:
    try:
        workload.to_batch(table)
    except (pa.ArrowException, ValueError, TypeError):
        return False
    return True


def first_bad_row(workload: Workload, table: pa.Table) -> int | None:
    """The first row of `table` that `to_batch` fails on: the shortest failing prefix, by
    bisection (to_batch converts rows independently). None if the whole table converts."""
    if _converts(workload, table):
        return None
    lo, hi = 0, table.num_rows  # the prefix of lo rows converts; that of hi rows does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _converts(workload, table.slice(0, mid)) else (lo, mid)
    return hi - 1


def bad_column(workload: Workload, table: pa.Table, row: int, probes: int = 8) -> str | None:
    """The column whose value in `row` `to_batch` fails on: that value put into a row that
    converts (one of the first `probes` others) makes it fail. None if no such row is found."""
    bad = table.slice(row, 1)
    others = [i for i in range(table.num_rows) if i != row][:probes]
    good = next((table.slice(i, 1) for i in others if _converts(workload, table.slice(i, 1))), None)
    if good is None:
        return None
    for c in workload.columns:
        i = good.schema.get_field_index(c)
        if not _converts(workload, good.set_column(i, good.schema.field(i), bad.column(c))):
            return c
    return None


def example_ids(table: pa.Table, workload: Workload, uri: str) -> torch.Tensor:
    """The workload's `id_column` as a batch's `example_id` (int64), read by the loader itself
    whatever `to_batch` returns: every prediction row and data fingerprint names its example."""
    column = table.column(workload.id_column)
    if not pa.types.is_integer(column.type) or column.null_count:
        what = f"has {column.null_count} null(s)" if column.null_count else f"is {column.type}"
        raise bad_ids(uri, workload, what)
    return torch.from_numpy(column.to_numpy().astype(np.int64))


def bad_ids(uri: str, workload: Workload, what: str) -> DataError:
    """The error for a file whose id column is not integers without nulls (`what` it is)."""
    return DataError(
        f"{uri}: column {workload.id_column!r} (id_column of workload {workload.name}) {what}; "
        "ids must be integers"
    )
