"""Batches for one rank, streamed from parquet row groups: a seeded, resumable training stream
and in-order eval batches. Only the workload's columns are read; a rank never holds more than
one shuffle window of its shard (plus the prefetch queue, see `prefetch.py`).

The training order (the shuffle trade-off). A full per-epoch permutation of the rows needs the
whole shard in memory (or a random read per example). Instead each epoch
1. permutes the shard's *pieces* (a row group, or the part of one that belongs to this rank)
   with a generator seeded from (data_seed, epoch), then
2. cuts that order into windows of `shuffle_window_row_groups` pieces and permutes the rows
   inside each window with a generator seeded from (data_seed, epoch, window).
Every example is seen once per epoch and examples from distant row groups meet in a batch as
often as the window allows; a larger window mixes better and costs memory (window rows x
row size). Rows written in a meaningful order (by label, by time) should be shuffled once
offline (`playbook preprocess` does) so that row groups are themselves mixed.

The batch for step s is rows [s*B, (s+1)*B) of that infinite sequence, so the stream can start
at any step from footers alone: the data position in a checkpoint is the step, and a resumed
run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from service.core.errors import DataError
from service.data.files import DataFile, ParquetReader, list_files
from service.data.sharding import RowRange
from service.workloads.base import Workload

Batch = dict[str, torch.Tensor]
DEFAULT_SHUFFLE_WINDOW_ROW_GROUPS = 4
READ_THREADS = os.cpu_count() or 1
"""Row groups of a window read at once: one per core (each read holds its decode buffers)."""


@dataclass(frozen=True)
class Piece:
    """Rows [lo, hi) of row group `row_group` of `uri` (a rank's share of one row group)."""

    uri: str
    row_group: int
    lo: int
    hi: int

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
    training stream's online augmentation)."""

    read_s: float = 0.0
    preprocess_s: float = 0.0
    augment_s: float = 0.0

    def take(self) -> tuple[float, float, float]:
        out = (self.read_s, self.preprocess_s, self.augment_s)
        self.read_s = self.preprocess_s = self.augment_s = 0.0
        return out


def pieces_of(ranges: list[RowRange], reader: ParquetReader) -> list[Piece]:
    """The row ranges cut at row-group boundaries (footers only)."""
    out = []
    for r in ranges:
        offset = 0
        for i, n in enumerate(reader.row_group_sizes(r.file.uri)):
            lo, hi = max(r.start, offset), min(r.stop, offset + n)
            if lo < hi:
                out.append(Piece(r.file.uri, i, lo - offset, hi - offset))
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

    def read(self, pieces: list[Piece]) -> Batch:
        t0 = time.perf_counter()
        table = self.read_table(pieces)
        self.stats.read_s += time.perf_counter() - t0
        return self.to_batch(table, pieces)

    def start(self, pieces: tuple[Piece, ...]) -> list[Future]:
        """Start reading the pieces on the reader's threads (a window read ahead, while the
        caller works on the one before); `finish` takes their rows."""
        return [self._threads().submit(_timed, self._cached_read, p) for p in pieces]

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
        self.stats.preprocess_s += time.perf_counter() - t0
        return tensors

    def where_to_batch_fails(self, table: pa.Table, pieces: list[Piece], error: Exception) -> str:
        """The error of `to_batch` on a window's rows, naming the file, the column and the row
        in the file (counted from 0) of the first value it fails on (`first_bad_row`,
        `bad_column`)."""
        w = self.workload
        reason = f"workload {w.name} cannot turn it into a batch ({str(error).splitlines()[0]})"
        row = first_bad_row(w, table)
        if row is None:
            return f"{pieces[0].uri}: {reason}"
        for p in pieces:  # the table is the pieces' rows in piece order
            if row < p.num_rows:
                break
            row -= p.num_rows
        file_row = sum(self.reader.row_group_sizes(p.uri)[: p.row_group]) + p.lo + row
        column = bad_column(w, table, sum(q.num_rows for q in pieces[: pieces.index(p)]) + row)
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
        raise DataError(
            f"{uri}: column {workload.id_column!r} (id_column of workload {workload.name}) {what}; "
            "ids must be integers"
        )
    return torch.from_numpy(column.to_numpy().astype(np.int64))


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

    def __len__(self) -> int:
        return len(self.order)

    def take(self, lo: int, hi: int) -> Batch:
        rows = self.order[lo:hi]
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
    """`rebatch`, as one list per chunk of the batches that chunk completes."""
    carry: Batch | None = None
    for chunk in chunks:
        rows = chunk if isinstance(chunk, Rows) else Rows(chunk)
        n, run, start = len(rows), [], 0
        if carry is not None:
            # Only the rows that complete the carried batch are copied, not the whole chunk.
            start = min(n, batch_size - len(carry["label"]))
            carry = {k: torch.cat([carry[k], v]) for k, v in rows.take(0, start).items()}
            if len(carry["label"]) < batch_size:  # a chunk shorter than the gap
                continue
            run.append(carry)
        full = start + (n - start) // batch_size * batch_size
        run += [rows.take(s, s + batch_size) for s in range(start, full, batch_size)]
        carry = rows.take(full, n) if full < n else None
        if run:
            yield run
    if keep_last and carry is not None:
        yield [carry]


class TrainStream:
    """Infinite shuffled batches of one rank's shard (see the module docstring for the order)."""

    def __init__(
        self,
        workload: Workload,
        ranges: list[RowRange],
        batch_size: int,
        data_seed: int,
        shuffle_window_row_groups: int = DEFAULT_SHUFFLE_WINDOW_ROW_GROUPS,
        cache_bytes: int = 0,
        hparams: dict | None = None,
    ):
        self.workload, self.batch_size, self.data_seed = workload, batch_size, data_seed
        self.hparams = dict(hparams or {})
        """The trial's hyperparameters, for the workload's `augment`."""
        self.window = shuffle_window_row_groups
        self.stats = LoaderStats()
        self.pieces = pieces_of(ranges, ParquetReader(workload.columns, workload))
        self.num_examples = sum(p.num_rows for p in self.pieces)
        if not self.num_examples:
            raise DataError("this rank's data shard is empty")
        self.cache_bytes = cache_bytes
        """Keep the shard's rows in memory after their first read when they fit (`WindowReader`)."""

    def _windows(self, epoch: int) -> list[list[Piece]]:
        order = np.random.default_rng([self.data_seed, epoch]).permutation(len(self.pieces))
        ordered = [self.pieces[i] for i in order]
        return [ordered[i : i + self.window] for i in range(0, len(ordered), self.window)]

    def plan(self, position: int) -> Iterator[WindowTask]:
        """The windows from example `position` of the infinite sequence on (footers only)."""
        epoch, offset = divmod(position, self.num_examples)
        while True:
            for w, pieces in enumerate(self._windows(epoch)):
                rows = sum(p.num_rows for p in pieces)
                if offset >= rows:  # before the start position: skipped
                    offset -= rows
                    continue
                yield WindowTask(epoch, w, tuple(pieces), offset)
                offset = 0
            epoch += 1

    def load(self, task: WindowTask, reader: WindowReader) -> Batch:
        """One window's rows, augmented and shuffled (`shuffled`), from its offset on, as one batch."""
        window = self.shuffled(task, reader.read(list(task.pieces)), reader.stats)
        return window.take(0, len(window))

    def shuffled(self, task: WindowTask, tensors: Batch, stats: LoaderStats) -> Shuffled:
        """A window's tensors augmented by the workload (`augment`, from the data seed and the
        epoch; its time counted in `stats`), in the window's order (data_seed, epoch, window),
        from its offset on."""
        start = time.perf_counter()
        tensors = self.workload.augment(tensors, self.hparams, self.data_seed, task.epoch)
        stats.augment_s += time.perf_counter() - start
        rows = sum(p.num_rows for p in task.pieces)
        perm = np.random.default_rng([self.data_seed, task.epoch, task.window]).permutation(rows)
        return Shuffled(tensors, perm[task.offset :])

    def _chunks(self, position: int, stats: LoaderStats) -> Iterator[Shuffled]:
        """The shuffled windows from example `position` on, each window's row groups decoded on
        the reader's threads while the one before is turned into tensors and consumed (memory:
        two windows' rows, whatever the data size)."""
        reader = WindowReader(self.workload, stats, self.cache_bytes)
        tasks = self.plan(position)
        try:
            task = next(tasks)
            started = reader.start(task.pieces)
            for following in tasks:
                table = reader.finish(started)
                started = reader.start(following.pieces)
                tensors = reader.to_batch(table, list(task.pieces))
                del table  # its rows are in the tensors now
                yield self.shuffled(task, tensors, stats)
                task = following
        finally:
            reader.close()

    def iterate(self, start_step: int = 0) -> Iterator[Batch]:
        """The batches of steps start_step, start_step + 1, ... (each a pure function of its step)."""
        return itertools.chain.from_iterable(self.runs(start_step))

    def runs(self, start_step: int = 0) -> Iterator[list[Batch]]:
        """`iterate`, as one list per window of the batches it completes (for a prefetch thread)."""
        return rebatch_runs(
            self._chunks(start_step * self.batch_size, self.stats), self.batch_size, keep_last=False
        )

    def batch(self, step: int) -> Batch:
        """The batch of one step (reads one or two windows; for checks, not for the loop, and
        not counted in `stats`)."""
        chunks = self._chunks(step * self.batch_size, LoaderStats())
        return next(rebatch(chunks, self.batch_size, keep_last=False))


def eval_batches(
    workload: Workload, ranges: list[RowRange], batch_size: int, keep: torch.Tensor | None = None
) -> Iterator[Batch]:
    """This rank's eval examples in file order, streamed one row group at a time, `batch_size`
    at a time (the last may be short); with `keep` (sorted positions inside the shard), only
    those examples (a fixed eval sample)."""
    if not ranges:
        return
    reader = WindowReader(workload)
    pieces = pieces_of(ranges, reader.reader)

    def chunks() -> Iterator[Batch]:
        offset = 0
        for p in pieces:
            if keep is None:
                yield reader.read([p])
            else:
                mine = keep[(keep >= offset) & (keep < offset + p.num_rows)] - offset
                if len(mine):
                    yield {k: v[mine] for k, v in reader.read([p]).items()}
            offset += p.num_rows

    try:
        yield from rebatch(chunks(), batch_size, keep_last=True)
    finally:
        reader.close()


def iterate_files(
    workload: Workload,
    uris: list[str],
    batch_size: int,
    data_seed: int = 0,
    prefetch_batches: int = 2,
    shuffle_window_row_groups: int = DEFAULT_SHUFFLE_WINDOW_ROW_GROUPS,
    source: Callable[[TrainStream, int], Iterator[Batch]] | None = None,
) -> Iterator[Batch]:
    """The training loader on its own (for benchmarks and scripts): infinite shuffled,
    prefetched batches over whole files (each a parquet file or a directory/glob of them),
    served by `source` (a `loop.BatchSource`; default: the prefetch thread)."""
    from service.data.prefetch import prefetch_stream

    files: list[DataFile] = [f for uri in uris for f in list_files(uri)]
    ranges = [RowRange(f, 0, f.num_rows) for f in files]
    stream = TrainStream(workload, ranges, batch_size, data_seed, shuffle_window_row_groups)
    if source is not None:
        return source(stream, 0)
    return prefetch_stream(stream, 0, prefetch_batches)


def unused_columns(workload: Workload, ranges: list[RowRange], probe_rows: int = 4) -> list[str]:
    """Declared feature columns that `to_batch` does not need: it still succeeds on a few rows
    without them (they are read for nothing; the input-bound verdict names them)."""
    reader = ParquetReader(workload.columns, workload)
    pieces = pieces_of(ranges, reader)
    if not pieces:
        return []
    table = reader.read_row_group(pieces[0].uri, pieces[0].row_group).slice(0, probe_rows)
    unused = []
    for c in workload.feature_columns:
        try:
            workload.to_batch(table.drop_columns([c]))
        except Exception:  # noqa: BLE001 - any failure means to_batch needs the column
            continue
        unused.append(c)
    return unused
