"""The training stream frees a window's tensors before it makes the next window's, so that the
allocator hands their memory to the next window instead of fresh pages (and the stream holds
one window's tensors, not two)."""

from __future__ import annotations

import weakref

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

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

    for prefetched in (False, True):
        workload = Watching()
        stream = TrainStream(workload, shard(tmp_path), 6, data_seed=3, shuffle_window_row_groups=2)
        batches = prefetch_stream(stream, 0, 2) if prefetched else stream.iterate(0)
        held = [next(batches) for _ in range(5 * 80 // 6)]
        if prefetched:
            batches.close()
        assert len(workload.alive_at_call) >= 20
        assert workload.alive_at_call == [0] * len(workload.alive_at_call), prefetched
        assert len(held) == 66
