"""The streaming loader: projection (unused columns never read), the windowed shuffle and its
resumability, bad files named with the column, prefetch, and memory bounded by the window."""

from __future__ import annotations

import io
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from fsspec.implementations.local import LocalFileOpener, LocalFileSystem

from service.core.errors import DataError
from service.data import loader
from service.data.files import ParquetReader, list_files
from service.data.loader import TrainStream, eval_batches, iterate_files
from service.data.prefetch import Prefetcher, prefetch, prefetch_stream
from service.data.sharding import RowRange
from service.workloads.digits import Digits
from tests.helpers.parquet_files import corrupt_column

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def digit_table(ids, junk_bytes: int = 0, pixel_type: pa.DataType | None = None) -> pa.Table:
    ids = np.asarray(ids, dtype=np.int64)
    pixels = np.random.default_rng(int(ids[0])).random((len(ids), 64)).astype(np.float32)
    cols = {
        "example_id": pa.array(ids),
        "pixels": pa.FixedSizeListArray.from_arrays(
            pa.array(pixels.reshape(-1), pixel_type or pa.float32()), 64
        ),
        "label": pa.array(ids % 10),
    }
    if junk_bytes:
        cols["junk"] = pa.array([os.urandom(junk_bytes) for _ in ids], pa.binary())
    return pa.table(cols)


def write(path, table: pa.Table, row_group_size: int) -> None:
    pq.write_table(table, path, row_group_size=row_group_size, use_dictionary=False, compression="none")


def whole_shard(directory) -> list[RowRange]:
    return [RowRange(f, 0, f.num_rows) for f in list_files(str(directory))]


def ids_of(batches) -> list[int]:
    return [i for b in batches for i in b["example_id"].tolist()]


# ---------------------------------------------------------------------------- projection


def test_a_column_the_workload_does_not_declare_is_never_decoded(tmp_path):
    write(tmp_path / "a.parquet", digit_table(range(0, 60), junk_bytes=50), row_group_size=16)
    write(tmp_path / "b.parquet", digit_table(range(100, 140), junk_bytes=50), row_group_size=16)
    for name in ("a.parquet", "b.parquet"):
        corrupt_column(tmp_path / name, "junk")
        with pytest.raises(OSError):  # the file really is unreadable as a whole
            pq.read_table(tmp_path / name)
    # ...yet a full epoch of training batches and the eval batches come through, every row intact.
    ranges = whole_shard(tmp_path)
    stream = TrainStream(Digits(), ranges, batch_size=10, data_seed=3, shuffle_window_row_groups=2)
    batches = list(zip(range(10), stream.iterate(0), strict=False))
    assert sorted(ids_of(b for _, b in batches)) == list(range(60)) + list(range(100, 140))
    expected = pa.concat_tables(
        [
            pq.read_table(tmp_path / n, columns=["example_id", "pixels", "label"])
            for n in ("a.parquet", "b.parquet")
        ]
    )
    by_id = dict(zip(expected["example_id"].to_pylist(), expected["pixels"].to_pylist(), strict=True))
    for _, b in batches:
        for i, px in zip(b["example_id"].tolist(), b["features"], strict=True):
            assert np.array_equal(px.reshape(-1).numpy(), np.asarray(by_id[i], dtype=np.float32))
    assert ids_of(eval_batches(Digits(), ranges, 32)) == expected["example_id"].to_pylist()


class CountingFileSystem(LocalFileSystem):
    """The local filesystem under `counting://`, counting every byte read through it."""

    protocol = "counting"
    bytes_read = 0

    def _open(self, path, mode="rb", **kwargs):
        return CountingFile(path, mode, fs=self, **kwargs)


class CountingFile(LocalFileOpener):
    def read(self, *args):
        data = self.f.read(*args)
        CountingFileSystem.bytes_read += len(data)
        return data


def test_bytes_read_exclude_the_unused_column(tmp_path):
    fsspec.register_implementation("counting", CountingFileSystem, clobber=True)
    path = tmp_path / "a.parquet"
    write(path, digit_table(range(200), junk_bytes=10_000), row_group_size=50)
    md = pq.read_metadata(path)
    junk = md.schema.to_arrow_schema().names.index("junk")
    junk_bytes = sum(md.row_group(i).column(junk).total_compressed_size for i in range(md.num_row_groups))
    assert junk_bytes > 0.8 * os.path.getsize(path)  # the column is most of the file
    files = list_files(f"counting://{path}")
    CountingFileSystem.bytes_read = 0
    stream = TrainStream(Digits(), [RowRange(files[0], 0, 200)], 20, data_seed=0)
    assert len(ids_of(b for _, b in zip(range(10), stream.iterate(0), strict=False))) == 200
    # The other columns plus pyarrow's speculative 64 KiB footer read, once per open of the file
    # (listing, planning, streaming): far from the 2 MB of the unused column.
    assert 0 < CountingFileSystem.bytes_read < os.path.getsize(path) - junk_bytes + 3 * 64 * 1024
    assert CountingFileSystem.bytes_read < junk_bytes / 5


def process_bytes_read() -> int:
    """Bytes this process has read by read(2) and its kin so far (from the page cache or not)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def test_a_local_row_group_is_decoded_in_place_from_a_memory_map(tmp_path):
    path = tmp_path / "a.parquet"
    write(path, digit_table(range(4000)), row_group_size=4000)
    columns = list(Digits().columns)
    reader = ParquetReader(tuple(columns))
    reader.row_group_sizes(str(path))  # the footer, read once and kept
    before = process_bytes_read()
    table = reader.read_row_group(str(path), 0)
    # Read rather than mapped, its column chunks (nearly the whole file) would be copied first.
    assert process_bytes_read() - before < os.path.getsize(path) / 20
    assert table.equals(pq.read_table(path, columns=columns))


# ---------------------------------------------------------------------------- order


@pytest.fixture
def many_groups(tmp_path):
    """Three files of 8-row row groups; the shard starts and ends inside row groups."""
    write(tmp_path / "a.parquet", digit_table(range(0, 37)), row_group_size=8)
    write(tmp_path / "b.parquet", digit_table(range(100, 124)), row_group_size=8)
    write(tmp_path / "c.parquet", digit_table(range(200, 230)), row_group_size=8)
    fa, fb, fc = list_files(str(tmp_path))
    ranges = [RowRange(fa, 5, 37), RowRange(fb, 0, 24), RowRange(fc, 0, 19)]
    shard_ids = list(range(5, 37)) + list(range(100, 124)) + list(range(200, 219))
    return ranges, shard_ids


def test_epochs_are_permutations_mixed_within_windows_only(many_groups):
    ranges, shard_ids = many_groups
    n, batch, window = len(shard_ids), 7, 2
    stream = TrainStream(Digits(), ranges, batch, data_seed=9, shuffle_window_row_groups=window)
    assert stream.num_examples == n
    steps = -(-3 * n // batch)
    ids = ids_of(b for _, b in zip(range(steps), stream.iterate(0), strict=False))
    epochs = [ids[e * n : (e + 1) * n] for e in range(3)]
    group_of = {}  # example id -> (file, row group), from pyarrow's own row-group boundaries
    for r in ranges:
        pf = pq.ParquetFile(r.file.uri)
        for g in range(pf.num_row_groups):
            for i in pf.read_row_group(g, columns=["example_id"])["example_id"].to_pylist():
                group_of[i] = (r.file.uri, g)
    num_windows = -(-len({group_of[i] for i in shard_ids}) // window)
    for order in epochs:
        assert sorted(order) == sorted(shard_ids)
        # Consecutive examples come from a window of at most `window` row groups: cut the order
        # wherever the set of groups seen so far would exceed it; every cut is a window edge.
        seen: set = set()
        windows = 0
        for i in order:
            if group_of[i] not in seen and len(seen) == window:
                seen, windows = set(), windows + 1
            seen.add(group_of[i])
        assert windows + 1 <= num_windows
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[0] != sorted(epochs[0])


def test_any_start_step_continues_the_same_sequence(many_groups):
    ranges, _ = many_groups
    make = lambda seed: TrainStream(Digits(), ranges, 5, data_seed=seed, shuffle_window_row_groups=3)  # noqa: E731
    reference = [b for _, b in zip(range(40), make(4).iterate(0), strict=False)]
    for start in (1, 7, 15, 16, 33):
        resumed = [b for _, b in zip(range(40 - start), make(4).iterate(start), strict=False)]
        for got, want in zip(resumed, reference[start:], strict=True):
            for key in want:
                assert torch.equal(got[key], want[key]), (start, key)
    other = [b for _, b in zip(range(40), make(5).iterate(0), strict=False)]
    assert ids_of(other) != ids_of(reference)


def documented_order(
    ranges: list[RowRange], seed: int, window: int, epochs: int, window_bytes: int = 0
) -> dict[str, np.ndarray]:
    """The training sequence as loader.py's docstring states it, by hand with pyarrow and numpy:
    each epoch the shard's pieces (row groups cut to the ranges) in the order permutation(seed,
    epoch), cut into windows of consecutive pieces, each at least `window` of them holding at
    least `window_bytes` (a piece's share of its row group's uncompressed bytes of the columns
    read, from the footer), each window's rows in the order permutation(seed, epoch, window)."""
    pieces, sizes = [], []
    for r in ranges:
        pf, offset = pq.ParquetFile(r.file.uri), 0
        read = [
            j
            for j in range(pf.metadata.num_columns)
            if pf.schema.column(j).path.split(".")[0] in Digits().columns
        ]
        for g in range(pf.num_row_groups):
            rg = pf.metadata.row_group(g)
            n, size = rg.num_rows, sum(rg.column(j).total_uncompressed_size for j in read)
            lo, hi = max(r.start, offset), min(r.stop, offset + n)
            if lo < hi:
                pieces.append(pf.read_row_group(g).slice(lo - offset, hi - lo))
                sizes.append(size * (hi - lo) // n)
            offset += n
    out = []
    for epoch in range(epochs):
        order = list(np.random.default_rng([seed, epoch]).permutation(len(pieces)))
        windows = [[]]
        for i in order:
            if len(windows[-1]) >= window and sum(sizes[j] for j in windows[-1]) >= window_bytes:
                windows.append([])
            windows[-1].append(i)
        for w, members in enumerate(windows):
            rows = pa.concat_tables([pieces[i] for i in members])
            out.append(rows.take(np.random.default_rng([seed, epoch, w]).permutation(rows.num_rows)))
    table = pa.concat_tables(out)
    pixels = table.column("pixels").combine_chunks().flatten().to_numpy().reshape(-1, 1, 8, 8)
    return {"example_id": table.column("example_id").to_numpy(), "features": pixels}


def check_documented_order(ranges, want: dict, make, batch: int) -> None:
    """The stream from `make()` gives the batch of step s as `want` from step 0, from any start
    step (a resume) and through the prefetch thread."""
    steps = len(want["example_id"]) // batch
    for start in (0, 1, 4, 11, 12, steps // 3 + 1):  # mid-window, window and epoch edges
        for prefetched in (False, True):
            stream = make()
            batches = prefetch_stream(stream, start, 2) if prefetched else stream.iterate(start)
            for s in range(start, steps):
                got = next(batches)
                rows = slice(s * batch, (s + 1) * batch)
                assert got["example_id"].tolist() == want["example_id"][rows].tolist(), (start, s)
                assert np.array_equal(got["features"].numpy(), want["features"][rows]), (start, s)
            if prefetched:
                batches.close()


def test_the_read_ahead_stream_is_the_documented_order_from_every_start_step(many_groups):
    """The stream (windows read ahead, batches gathered from each shuffled window) gives the
    batch of step s as the documented order computed by hand, from step 0, from any start step
    (a resume) and through the prefetch thread."""
    ranges, _ = many_groups
    batch, window, seed = 7, 3, 6
    want = documented_order(ranges, seed, window, epochs=3)
    for cache in (0, 1 << 20):  # with the cache, later epochs index the cached shard's tensors
        make = lambda cache=cache: TrainStream(  # noqa: E731
            Digits(), ranges, batch, data_seed=seed, shuffle_window_row_groups=window, cache_bytes=cache
        )
        check_documented_order(ranges, want, make, batch)


def test_windows_counted_in_bytes_are_the_documented_order_from_every_start_step(many_groups):
    """`shuffle_window_bytes`: each window takes pieces until it holds that many bytes (and at
    least `shuffle_window_row_groups` pieces), so windows of partial and whole row groups hold
    different numbers of them; the order is still the documented one from every start."""
    ranges, _ = many_groups
    batch, seed, window_bytes = 7, 6, 5000  # an 8-row group holds about 2.2 kB here
    want = documented_order(ranges, seed, 1, epochs=3, window_bytes=window_bytes)
    assert not np.array_equal(want["example_id"], documented_order(ranges, seed, 2, epochs=3)["example_id"])
    make = lambda cache=0: TrainStream(  # noqa: E731
        Digits(),
        ranges,
        batch,
        data_seed=seed,
        shuffle_window_row_groups=1,
        shuffle_window_bytes=window_bytes,
        cache_bytes=cache,
    )
    sizes = {len(t.pieces) for t in itertools.islice(make().plan(0), 6)}
    assert len(sizes) > 1 and min(sizes) >= 2  # pieces per window vary with their sizes
    check_documented_order(ranges, want, make, batch)
    check_documented_order(ranges, want, lambda: make(1 << 20), batch)  # the cached shard's path


def test_the_next_window_is_read_while_this_one_becomes_tensors(many_groups, monkeypatch):
    """While `to_batch` turns a window's rows into tensors, the next window's row groups are
    already being read (on the reader's threads)."""
    ranges, _ = many_groups
    reads = threading.Semaphore(0)
    real_read = ParquetReader.read_row_group

    def counted(self, *args, **kwargs):
        reads.release()
        return real_read(self, *args, **kwargs)

    monkeypatch.setattr(ParquetReader, "read_row_group", counted)
    window, seen = 2, []

    class Watching(Digits):
        def to_batch(self, table):  # the pieces of this window and the next one have started
            started = sum(reads.acquire(timeout=5) for _ in range(2 * window if not seen else window))
            seen.append(started)
            return super().to_batch(table)

    stream = TrainStream(Watching(), ranges, 5, data_seed=1, shuffle_window_row_groups=window)
    batches = stream.iterate(0)
    while len(seen) < 3:
        next(batches)
    assert seen[:3] == [2 * window, window, window]


def test_a_cached_shard_gives_the_same_batches_and_reads_no_file_after_its_first_epoch(tmp_path):
    """input.cache_mb: the shard's rows kept after their first read (it fits the budget), so
    later epochs read no byte; the batches are the streaming loader's, from any start step.
    A budget the shard does not fit leaves it streamed every epoch."""
    fsspec.register_implementation("counting", CountingFileSystem, clobber=True)
    for j in range(3):
        write(tmp_path / f"part-{j}.parquet", digit_table(range(j * 60, (j + 1) * 60)), row_group_size=20)
    ranges = [RowRange(f, 0, f.num_rows) for f in list_files(f"counting://{tmp_path}")]
    batch, steps_per_epoch = 12, 180 // 12

    def epochs_read(cache_bytes: int) -> tuple[list[dict], list[int]]:
        stream = TrainStream(Digits(), ranges, batch, data_seed=4, cache_bytes=cache_bytes)
        batches, read = [], []
        it = stream.iterate(0)
        for _ in range(3):
            before = CountingFileSystem.bytes_read
            batches += [next(it) for _ in range(steps_per_epoch)]
            read.append(CountingFileSystem.bytes_read - before)
        return batches, read

    streamed, streamed_read = epochs_read(0)
    cached, cached_read = epochs_read(1 << 20)
    too_small, too_small_read = epochs_read(10_000)  # < the 180 rows' 46 KB of pixels
    for got in (cached, too_small):
        for a, b in zip(got, streamed, strict=True):
            assert all(torch.equal(a[k], b[k]) for k in b)
    assert min(streamed_read) > 0 and min(too_small_read) > 0
    assert cached_read[0] > 0 and cached_read[1:] == [0, 0]
    # from a middle step (a resume) the cached stream continues the same sequence
    resumed = TrainStream(Digits(), ranges, batch, data_seed=4, cache_bytes=1 << 20).iterate(20)
    for b in streamed[20:40]:
        assert torch.equal(next(resumed)["example_id"], b["example_id"])


def test_a_window_of_the_whole_cached_shard_is_turned_into_tensors_once(many_groups):
    """A window that holds the whole shard (small data) keeps its tensors as the cached
    shard's: `to_batch` runs once in three epochs, and the batches are the documented order
    from every start step. Without the cache every window is turned into tensors again."""
    ranges, _ = many_groups
    batch, seed = 7, 6
    want = documented_order(ranges, seed, 100, epochs=3)  # every piece in one window

    class Counting(Digits):
        calls = 0

        def to_batch(self, table):
            Counting.calls += 1
            return super().to_batch(table)

    for cache, calls in ((1 << 20, 1), (0, 3)):
        make = lambda cache=cache: TrainStream(  # noqa: E731
            Counting(), ranges, batch, data_seed=seed, shuffle_window_row_groups=100, cache_bytes=cache
        )
        check_documented_order(ranges, want, make, batch)
        Counting.calls = 0
        it = make().iterate(0)
        for _ in range(len(want["example_id"]) // batch):  # three epochs
            next(it)
        assert Counting.calls == calls, cache


@pytest.mark.parametrize("order_rows", [1, 20, loader.ORDER_ROWS])
def test_a_shard_in_memory_is_the_documented_order_whatever_its_bursts(many_groups, monkeypatch, order_rows):
    """Once the shard is in memory its order is computed `ORDER_ROWS` rows at a time (a burst
    of windows, the rows of an unfinished batch carried to the next): still the documented
    order from every start step, with bursts shorter than a window, a batch or an epoch."""
    monkeypatch.setattr(loader, "ORDER_ROWS", order_rows)
    ranges, _ = many_groups
    batch, window, seed = 7, 2, 5
    want = documented_order(ranges, seed, window, epochs=4)
    make = lambda: TrainStream(  # noqa: E731
        Digits(), ranges, batch, data_seed=seed, shuffle_window_row_groups=window, cache_bytes=1 << 20
    )
    check_documented_order(ranges, want, make, batch)


def test_a_shard_in_memory_computes_its_order_in_bursts_and_serves_it_a_window_at_a_time(
    many_groups, monkeypatch
):
    """Per-window work done a window at a time runs cold between the steps of a small shard:
    once the shard is in memory, the order of the windows holding `ORDER_ROWS` rows is
    computed at once (no window's order between two bursts), and served in runs of about a
    window's batches (what a prefetch thread holds at once)."""
    monkeypatch.setattr(loader, "ORDER_ROWS", 150)  # two epochs of the 75-row shard
    ranges, shard_ids = many_groups
    batch, window = 7, 2  # windows of two 8-row groups or parts of them: at most 16 rows

    class Counting(TrainStream):
        windows = 0

        def window_order(self, task, rows):
            Counting.windows += 1
            return super().window_order(task, rows)

    stream = Counting(
        Digits(), ranges, batch, data_seed=3, shuffle_window_row_groups=window, cache_bytes=1 << 20
    )
    runs, bursts = stream.runs(0), []
    for run in itertools.islice(runs, 100):
        assert 0 < len(run) <= 16 // batch + 1
        if stream.stats.in_memory:
            bursts.append(Counting.windows)
    epochs = [w for w in np.diff(bursts) if w]  # windows computed at each burst
    assert len(epochs) >= 3 and all(w >= 150 // 16 for w in epochs), bursts
    runs.close()


def test_eval_batches_stream_the_shard_in_file_order_with_a_sample(many_groups):
    ranges, shard_ids = many_groups
    assert ids_of(eval_batches(Digits(), ranges, 6)) == shard_ids
    assert [len(b["label"]) for b in eval_batches(Digits(), ranges, 6)][-1] == (len(shard_ids) % 6 or 6)
    keep = torch.tensor([0, 3, 8, 9, 30, 31, 32, 70, 74])
    assert ids_of(eval_batches(Digits(), ranges, 4, keep)) == [shard_ids[i] for i in keep.tolist()]


# ---------------------------------------------------------------------------- bad files


def test_a_corrupt_declared_column_names_the_file_and_the_column(tmp_path):
    write(tmp_path / "a.parquet", digit_table(range(40)), row_group_size=10)
    corrupt_column(tmp_path / "a.parquet", "pixels")
    stream = TrainStream(Digits(), whole_shard(tmp_path), 8, data_seed=0)
    with pytest.raises(DataError, match=r"a\.parquet: column 'pixels': cannot read row group"):
        next(stream.iterate(0))


def test_a_truncated_file_is_named(tmp_path):
    write(tmp_path / "a.parquet", digit_table(range(40)), row_group_size=10)
    data = (tmp_path / "a.parquet").read_bytes()
    (tmp_path / "a.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"a\.parquet: not a readable parquet file"):
        list_files(str(tmp_path))


def test_a_schema_mismatch_names_the_file_and_the_column(tmp_path):
    write(tmp_path / "a.parquet", digit_table(range(40)), row_group_size=10)
    write(tmp_path / "b.parquet", digit_table(range(40, 80), pixel_type=pa.float64()), row_group_size=10)
    with pytest.raises(
        DataError, match=r"b\.parquet: column 'pixels' has type fixed_size_list<element: double>"
    ):
        TrainStream(Digits(), whole_shard(tmp_path), 8, data_seed=0)
    write(tmp_path / "b.parquet", digit_table(range(40, 80)).drop_columns(["label"]), row_group_size=10)
    with pytest.raises(DataError, match=r"b\.parquet: missing column 'label'"):
        list(eval_batches(Digits(), whole_shard(tmp_path), 8))


# ---------------------------------------------------------------------------- prefetch


def test_prefetch_keeps_order_forwards_errors_and_stops_its_thread():
    def source():
        yield from range(5)
        raise DataError("x.parquet: broken")

    before = threading.active_count()
    it = prefetch(source(), 2)
    assert [next(it) for _ in range(5)] == list(range(5))
    with pytest.raises(DataError, match="x.parquet"):
        next(it)
    endless = prefetch(iter(range(10**9)), 3)
    assert next(endless) == 0
    del it, endless  # dropping a prefetcher stops its thread
    for _ in range(100):
        if threading.active_count() <= before:
            break
        threading.Event().wait(0.05)
    assert threading.active_count() <= before


def test_prefetch_hands_over_whole_runs_and_starts_the_next_below_depth():
    pulled = []

    def runs():  # runs of 5 items, as a window's batches
        for r in range(100):
            pulled.append(r)
            yield [(r, i) for i in range(5)]

    def settled(n: int) -> bool:  # the thread has pulled n runs (and no more)
        for _ in range(100):
            if len(pulled) >= n:
                break
            threading.Event().wait(0.01)
        threading.Event().wait(0.05)
        return len(pulled) == n

    it = Prefetcher(runs(), depth=2)
    assert settled(1)
    assert [next(it) for _ in range(3)] == [(0, 0), (0, 1), (0, 2)]
    assert settled(1)  # 2 items ready: not below the depth
    assert next(it) == (0, 3)
    assert settled(2)  # 1 ready: the next run is prepared
    assert [next(it) for _ in range(6)] == [(0, 4)] + [(1, i) for i in range(5)]
    it.close()


def test_prefetch_hands_the_source_over_to_the_consumer_when_asked():
    """`handover`: once it is true after a run, the thread ends and the consumer's own thread
    computes the later runs, the items in the same order; an error of the source is raised in
    the consumer on every later next(), and `close()` closes the source."""
    computed_by, closed, handed = [], [], threading.Event()

    def runs():
        try:
            for r in range(6):
                computed_by.append(threading.current_thread().name)
                if r == 2:
                    handed.set()  # as the loader marks its shard in memory before the run
                if r == 5:
                    raise DataError("x.parquet: broken")
                yield [(r, i) for i in range(3)]
        finally:
            closed.append(True)

    it = Prefetcher(runs(), depth=2, handover=handed.is_set)
    thread = it._thread
    assert [next(it) for _ in range(15)] == [(r, i) for r in range(5) for i in range(3)]
    thread.join(timeout=10)
    assert not thread.is_alive()
    me = threading.current_thread().name
    assert computed_by == ["playbook-prefetch"] * 3 + [me, me]
    for _ in range(2):  # raised again on a later next(), as before the handover
        with pytest.raises(DataError, match="x.parquet"):
            next(it)
    assert computed_by[5:] == [me] and closed == [True]
    it.close()
    assert closed == [True]

    handed.clear()
    closed.clear()
    it = Prefetcher(runs(), depth=2, handover=lambda: True)
    assert next(it) == (0, 0)
    it._thread.join(timeout=10)
    it.close()
    assert closed == [True]


@pytest.mark.timeout(60)
def test_after_close_the_prefetcher_serves_what_was_ready_then_ends():
    """`close()` stops the thread; later next() calls serve the items it had made ready and then
    end the stream (StopIteration), rather than wait for a thread that has stopped."""
    it = Prefetcher(iter([[i, i] for i in range(10**6)]), depth=2)
    assert next(it) == 0
    it.close()
    rest = list(it)  # ends: with the thread stopped, an end marker follows the ready items
    assert rest == sorted(rest) and len(rest) < 10


@pytest.mark.parametrize("case", ["cached", "not_cached", "augments"])
def test_a_cpu_stream_ends_its_prefetch_thread_once_its_shard_is_in_memory(many_groups, case):
    """On CPU the prefetch thread ends once a plain workload's shard is in memory (each batch
    is then an index into its tensors, gathered by the step itself), with the same batches. A
    shard streamed every epoch (no cache) or augmented every epoch keeps its thread."""

    class Augmenting(Digits):
        def augment(self, tensors, hparams, data_seed, epoch):
            return tensors

    ranges, shard_ids = many_groups
    workload = Augmenting() if case == "augments" else Digits()
    cache = 0 if case == "not_cached" else 1 << 20

    def make():
        return TrainStream(workload, ranges, 7, data_seed=3, shuffle_window_row_groups=2, cache_bytes=cache)

    before = set(threading.enumerate())
    batches = prefetch_stream(make(), 0, 2)
    (thread,) = [t for t in threading.enumerate() if t not in before and t.name == "playbook-prefetch"]
    want = make().iterate(0)
    for _ in range(3 * len(shard_ids) // 7):  # three epochs
        got, expected = next(batches), next(want)
        assert all(torch.equal(got[k], expected[k]) for k in expected)
    thread.join(timeout=0.5)
    assert thread.is_alive() == (case != "cached")
    batches.close()
    thread.join(timeout=10)
    assert not thread.is_alive()


# ---------------------------------------------------------------------------- memory

MEASURE = """
import json, os, sys
import pyarrow as pa
from service.data.loader import iterate_files
from service.workloads.digits import Digits
def rss():  # resident bytes now
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
directory, rows = sys.argv[1], int(sys.argv[2])
before = rss()
batches = iterate_files(Digits(), [directory], batch_size=256, prefetch_batches=4)
seen, peak = 0, before
while seen < rows:  # one whole epoch, resident size sampled after every batch
    seen += len(next(batches)["label"])
    peak = max(peak, rss())
print(json.dumps({"rss_growth": peak - before, "arrow_peak": pa.default_memory_pool().max_memory()}))
"""


def measure(directory, rows: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(directory), str(rows)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_loader_memory_does_not_grow_with_the_dataset(tmp_path):
    """One epoch over 20k rows and over 200k rows (10x, ~50 MiB of pixels): the arrow pool's
    peak and the process's peak RSS growth stay about the same (bounded by the shuffle window,
    the one read ahead and the prefetch queue, not by the data)."""
    sizes = {"small": 20_000, "large": 200_000}
    for name, rows in sizes.items():
        (tmp_path / name).mkdir()
        per_file = rows // 4
        for j in range(4):
            write(
                tmp_path / name / f"part-{j}.parquet",
                digit_table(range(j * per_file, (j + 1) * per_file)),
                2000,
            )
    # Each size's median of three fresh processes: a single run's peak moves by several MB with
    # which of the reading threads' malloc arenas the freed windows land in (run to run, the
    # difference of single peaks ranged over -9..+7 MB; one run in about twenty passed 1/10 of
    # the data).
    small, large = (median_of_runs(tmp_path / name, rows) for name, rows in sizes.items())
    print("loader memory", small, large)
    data_bytes = sizes["large"] * 64 * 4
    window_bytes = 4 * 2000 * (64 * 4 + 8 + 8)  # the default 4 row groups of 2000 rows
    assert large["arrow_peak"] < 2 * small["arrow_peak"] + (1 << 20)
    # Two windows' rows (the one turned into tensors, the next one read ahead) and the decoder's
    # buffers of the row groups it decodes.
    assert large["arrow_peak"] < 4 * window_bytes
    # Resident growth includes a fixed ~90 MB (threads, first torch ops, lazily loaded code);
    # what the 10x data adds must be a small fraction of the 51 MB more data (a loader that kept
    # a fifth of it would fail).
    assert large["rss_growth"] - small["rss_growth"] < data_bytes / 5


def median_of_runs(directory, rows: int, runs: int = 3) -> dict:
    results = [measure(directory, rows) for _ in range(runs)]
    return {k: statistics.median(r[k] for r in results) for k in results[0]}


def test_iterate_files_is_the_training_stream_on_whole_files(many_groups, tmp_path):
    ranges, _ = many_groups
    directory = os.path.dirname(ranges[0].file.uri)
    full = whole_shard(directory)
    want = TrainStream(Digits(), full, 9, data_seed=2, shuffle_window_row_groups=3).iterate(0)
    got = iterate_files(
        Digits(), [directory], 9, data_seed=2, prefetch_batches=2, shuffle_window_row_groups=3
    )
    for _ in range(20):
        assert torch.equal(next(got)["example_id"], next(want)["example_id"])


def test_on_gcs_the_unused_column_is_not_fetched(gcs_emulator, monkeypatch):
    """The same on gs:// through gcsfs (against the emulator): a read block larger than the
    column chunks (gcsfs reads 5 MiB blocks by default) would fetch the unused column with
    them. Bytes are counted where gcsfs sends each GET (a spy around its own method)."""
    import gcsfs.core

    from service.core import storage

    local = io.BytesIO()
    pq.write_table(digit_table(range(200), junk_bytes=10_000), local, row_group_size=50)
    uri = f"{gcs_emulator}/projection/a.parquet"
    storage.write_bytes_atomic(uri, local.getvalue())
    md = pq.read_metadata(io.BytesIO(local.getvalue()))
    junk = md.schema.to_arrow_schema().names.index("junk")
    junk_bytes = sum(md.row_group(i).column(junk).total_compressed_size for i in range(md.num_row_groups))
    assert junk_bytes > 0.8 * len(local.getvalue())

    fetched = []
    original = gcsfs.core.GCSFileSystem._cat_file_sequential  # every ranged GET of gcsfs

    async def counting(self, path, start=None, end=None, **kwargs):
        data = await original(self, path, start=start, end=end, **kwargs)
        fetched.append(len(data))
        return data

    monkeypatch.setattr(gcsfs.core.GCSFileSystem, "_cat_file_sequential", counting)
    files = list_files(f"{gcs_emulator}/projection")
    stream = TrainStream(Digits(), [RowRange(files[0], 0, 200)], 20, data_seed=0)
    assert len(ids_of(b for _, b in zip(range(10), stream.iterate(0), strict=False))) == 200
    assert fetched and sum(fetched) < junk_bytes / 5, (sum(fetched), junk_bytes)
