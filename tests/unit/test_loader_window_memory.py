"""Per-window costs of the training stream: it frees a window's tensors before it makes the next
window's (the allocator hands their memory to the next window instead of fresh pages, and the
stream holds one window's tensors, not two), and a window served from the cache is not sent to
the reading threads."""

from __future__ import annotations

import weakref

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from service.data.files import list_files
from service.data.prefetch import prefetch_stream
from service.data.sharding import RowRange
from service.workloads.digits import Digits


class Watching(Digits):
    """Digits noting, at each `to_batch`, how many tensors it made before are still alive."""

    def __init__(self):
        self.made: list[weakref.ref] = []
        self.alive_at_call: list[int] = []

    def to_batch(self, table: pa.Table):
        self.alive_at_call.append(sum(ref() is not None for ref in self.made))
        tensors = super().to_batch(table)
        self.made += [weakref.ref(v) for v in tensors.values()]
        return tensors


def shard(tmp_path) -> list[RowRange]:
    for j in range(2):
        ids = np.arange(j * 40, (j + 1) * 40, dtype=np.int64)
        pixels = np.random.default_rng(j).random((40, 64), dtype=np.float32).reshape(-1)
        table = pa.table(
            {
                "example_id": pa.array(ids),
                "pixels": pa.FixedSizeListArray.from_arrays(pa.array(pixels), 64),
                "label": pa.array(ids % 10),
            }
        )
        pq.write_table(table, tmp_path / f"part-{j}.parquet", row_group_size=10)
    return [RowRange(f, 0, f.num_rows) for f in list_files(str(tmp_path))]


def test_a_window_is_freed_before_the_next_one_is_made(tmp_path):
    """Over 20 windows (8 row groups, 2 per window, 5 epochs), directly and through the
    prefetch thread, while the consumer holds the batches it drew: at every `to_batch` no
    tensor of an earlier window is alive (the batches are gathered copies)."""
    from service.data.loader import TrainStream

    # Written once: the first stream's reading threads still read ahead, and rewriting the files
    # they map under them is a bus error.
    rows = shard(tmp_path)
    for prefetched in (False, True):
        workload = Watching()
        stream = TrainStream(workload, rows, 6, data_seed=3, shuffle_window_row_groups=2)
        batches = prefetch_stream(stream, 0, 2) if prefetched else stream.iterate(0)
        held = [next(batches) for _ in range(5 * 80 // 6)]
        if prefetched:
            batches.close()
        assert len(workload.alive_at_call) >= 20
        assert workload.alive_at_call == [0] * len(workload.alive_at_call), prefetched
        assert len(held) == 66


def test_a_cached_window_is_not_sent_to_the_reading_threads(tmp_path, monkeypatch):
    """With the shard cached (input.cache_mb), the pieces of a window after the first epoch are
    taken from the cache on the stream's own thread: nothing is submitted to the reading
    threads, and the batches are the uncached stream's."""
    from concurrent.futures import ThreadPoolExecutor

    from service.data.loader import TrainStream

    submitted = []
    real_submit = ThreadPoolExecutor.submit

    def counted(self, fn, *args, **kwargs):
        submitted.append(fn)
        return real_submit(self, fn, *args, **kwargs)

    monkeypatch.setattr(ThreadPoolExecutor, "submit", counted)
    ranges = shard(tmp_path)  # 8 pieces of 10 rows: an epoch is 80 rows, 10 batches of 8
    cached = TrainStream(Digits(), ranges, 8, data_seed=5, cache_bytes=1 << 20).iterate(0)
    plain = TrainStream(Digits(), ranges, 8, data_seed=5).iterate(0)
    first = [next(cached) for _ in range(10)]
    after_first = len(submitted)
    later = [next(cached) for _ in range(20)]
    assert after_first >= 8  # the first epoch read every piece on the threads
    assert len(submitted) <= after_first + 2  # at most the 2nd epoch's first window read ahead
    for got in first + later:
        want = next(plain)
        assert all(torch.equal(got[k], want[k]) for k in want)
