"""Data sharding and loading: host file assignment, row ranges, the training stream, file listing."""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from service.core.errors import DataError
from service.data.files import DataFile, list_files
from service.data.loader import TrainStream
from service.data.sharding import RowRange, files_for_hosts, row_ranges, train_shard
from service.workloads.digits import Digits


def synthetic_files(rows: list[int]) -> list[DataFile]:
    return [DataFile(f"mem://data/part-{i:05d}.parquet", n) for i, n in enumerate(rows)]


FILE_SETS = [
    (synthetic_files([100, 90, 80, 10, 10, 5]), 2),
    (synthetic_files([7, 7, 7, 7, 7]), 3),
    (synthetic_files([1000, 1, 1, 1, 1, 1, 1, 1]), 4),
    (synthetic_files(np.random.default_rng(0).integers(1, 500, 23).tolist()), 5),
    (synthetic_files(np.random.default_rng(1).integers(1, 50, 9).tolist()), 9),
]


@pytest.mark.parametrize(("files", "num_hosts"), FILE_SETS)
def test_files_for_hosts_disjoint_complete_balanced(files, num_hosts):
    shards = files_for_hosts(files, num_hosts)
    assert len(shards) == num_hosts
    assigned = [f.uri for shard in shards for f in shard]
    assert sorted(assigned) == sorted(f.uri for f in files)  # complete, and no file twice
    assert all(shard for shard in shards)  # every host gets at least one file
    loads = [sum(f.num_rows for f in shard) for shard in shards]
    assert max(loads) - min(loads) <= max(f.num_rows for f in files)
    # Deterministic: a second call on an equal (freshly built) list gives the same shards.
    again = files_for_hosts([DataFile(f.uri, f.num_rows) for f in files], num_hosts)
    assert [[f.uri for f in s] for s in again] == [[f.uri for f in s] for s in shards]


@pytest.mark.parametrize(
    ("rows", "num_hosts"),
    [
        ([9, 8, 7, 6, 5, 4, 3, 2], 2),
        ([9, 8, 7, 6, 5, 4, 3, 2], 3),
        ([3, 3, 2, 2, 2], 2),
        ([50, 49, 26, 25, 24, 1], 3),
        ([10, 6, 6, 4, 2, 1, 1], 3),  # dealing the sorted files round-robin gives 15 (best: 10)
        ([1, 1, 1, 1, 4], 2),  # assigning in the given order, largest last, gives 6 (best: 4)
    ],
)
def test_files_for_hosts_close_to_optimal(rows, num_hosts):
    """Greedy longest-first is within 4/3 - 1/(3m) of the best possible largest host load,
    found here by trying every assignment."""
    files = synthetic_files(rows)
    best = min(
        max(sum(r for r, h in zip(rows, hosts, strict=True) if h == k) for k in range(num_hosts))
        for hosts in itertools.product(range(num_hosts), repeat=len(rows))
    )
    largest = max(sum(f.num_rows for f in s) for s in files_for_hosts(files, num_hosts))
    assert 3 * num_hosts * largest <= (4 * num_hosts - 1) * best  # exact integer form


def test_files_for_hosts_matches_a_plain_longest_first_loop():
    """The heap-based assignment gives exactly what the textbook loop gives: each file, largest
    first (ties by URI), to the host with the fewest rows so far (ties by host index)."""
    rng = np.random.default_rng(7)
    files = synthetic_files(rng.integers(0, 40, 400).tolist())  # many ties, some empty files
    num_hosts = 13
    loads, expected = [0] * num_hosts, [[] for _ in range(num_hosts)]
    for f in sorted(files, key=lambda f: (-f.num_rows, f.uri)):
        host = min(range(num_hosts), key=lambda h: (loads[h], h))
        expected[host].append(f.uri)
        loads[host] += f.num_rows
    shards = files_for_hosts(files, num_hosts)
    assert [[f.uri for f in s] for s in shards] == [sorted(e) for e in expected]


def test_fewer_files_than_hosts_is_a_data_error():
    files = synthetic_files([10, 20])
    with pytest.raises(DataError, match="part-00000.parquet") as info:
        files_for_hosts(files, 3)
    assert "3 hosts" in str(info.value)


@pytest.mark.parametrize("rows", [[7, 0, 13, 1, 9], [3], [2, 1]])
@pytest.mark.parametrize("num_parts", [1, 2, 3, 4, 5])
def test_row_ranges_cover_every_row_exactly_once(rows, num_parts):
    files = synthetic_files(rows)
    expected = []
    for f in files:
        for i in range(f.num_rows):
            expected.append((f.uri, i))
    parts = [row_ranges(files, p, num_parts) for p in range(num_parts)]
    got = [(r.file.uri, i) for ranges in parts for r in ranges for i in range(r.start, r.stop)]
    assert got == expected
    sizes = [sum(r.stop - r.start for r in ranges) for ranges in parts]
    assert max(sizes) - min(sizes) <= 1
    assert all(r.start < r.stop for ranges in parts for r in ranges)


def test_train_shard_covers_every_row_once_over_hosts_and_workers():
    files = synthetic_files([40, 33, 21, 17, 5])
    seen = []
    for host, local in itertools.product(range(2), range(3)):
        for r in train_shard(files, 2, host, 3, local):
            seen.extend((r.file.uri, i) for i in range(r.start, r.stop))
    assert sorted(seen) == sorted((f.uri, i) for f in files for i in range(f.num_rows))


# ---------------------------------------------------------------------------- TrainStream


def write_digit_like(path, ids) -> None:
    rng = np.random.default_rng(int(ids[0]))
    pixels = rng.random((len(ids), 64), dtype=np.float32)
    table = pa.table(
        {
            "example_id": pa.array(ids, pa.int64()),
            "pixels": pa.FixedSizeListArray.from_arrays(pa.array(pixels.reshape(-1)), 64),
            "label": pa.array(np.asarray(ids) % 10, pa.int64()),
        }
    )
    pq.write_table(table, path)


@pytest.fixture
def shard(tmp_path):
    """Two files; the shard is rows 3.. of the first and rows ..8 of the second (20 rows)."""
    write_digit_like(tmp_path / "a.parquet", list(range(0, 15)))
    write_digit_like(tmp_path / "b.parquet", list(range(100, 112)))
    fa, fb = list_files(str(tmp_path))
    ranges = [RowRange(fa, 3, 15), RowRange(fb, 0, 8)]
    by_id = {}
    for path, start, stop in ((tmp_path / "a.parquet", 3, 15), (tmp_path / "b.parquet", 0, 8)):
        t = pq.read_table(path).slice(start, stop - start)
        for i, px, label in zip(
            t.column("example_id").to_pylist(),
            t.column("pixels").to_pylist(),
            t.column("label").to_pylist(),
            strict=True,
        ):
            by_id[i] = (px, label)
    return ranges, by_id


def epoch_orders(stream: TrainStream, num_epochs: int) -> list[list[int]]:
    n, b = stream.num_examples, stream.batch_size
    steps = -(-num_epochs * n // b)
    ids = torch.cat([stream.batch(s)["example_id"] for s in range(steps)]).tolist()
    return [ids[e * n : (e + 1) * n] for e in range(num_epochs)]


def test_each_epoch_is_a_permutation_of_the_shard(shard):
    ranges, by_id = shard
    stream = TrainStream(Digits(), ranges, batch_size=6, data_seed=11)  # 6 does not divide 20
    assert stream.num_examples == 20
    orders = epoch_orders(stream, 3)
    for order in orders:
        assert sorted(order) == sorted(by_id)
    assert orders[0] != orders[1] != orders[2]  # reshuffled every epoch
    # Features and labels travel with their example id.
    for step in range(4):
        batch = stream.batch(step)
        for i, px, label in zip(
            batch["example_id"].tolist(), batch["features"], batch["label"].tolist(), strict=True
        ):
            assert label == by_id[i][1]
            assert np.array_equal(px.reshape(-1).numpy(), np.asarray(by_id[i][0], dtype=np.float32))


def test_order_depends_on_the_seed_only(shard):
    ranges, _ = shard
    a = epoch_orders(TrainStream(Digits(), ranges, 6, data_seed=11), 2)
    b = epoch_orders(TrainStream(Digits(), ranges, 6, data_seed=11), 2)
    c = epoch_orders(TrainStream(Digits(), ranges, 6, data_seed=12), 2)
    assert a == b
    assert a[0] != c[0] and a[1] != c[1]


def test_batch_is_a_pure_function_of_the_step(shard):
    ranges, _ = shard
    in_order = TrainStream(Digits(), ranges, 6, data_seed=5)
    expected = {s: in_order.batch(s) for s in range(15)}
    shuffled = TrainStream(Digits(), ranges, 6, data_seed=5)
    steps = list(np.random.default_rng(0).permutation(15)) + [14, 0, 7, 0]
    for s in steps:
        got = shuffled.batch(int(s))
        for key in expected[s]:
            assert torch.equal(got[key], expected[s][key]), (s, key)


# ---------------------------------------------------------------------------- list_files


def test_list_files_sorted_with_row_counts(tmp_path):
    write_digit_like(tmp_path / "b.parquet", list(range(100, 107)))
    write_digit_like(tmp_path / "a.parquet", list(range(0, 5)))
    (tmp_path / "notes.txt").write_text("not data")
    files = list_files(str(tmp_path))
    assert [f.uri for f in files] == [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]
    assert [f.num_rows for f in files] == [pq.read_metadata(f.uri).num_rows for f in files] == [5, 7]


def test_list_files_missing_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError, match="nowhere"):
        list_files(str(missing))


def test_list_files_directory_without_parquet(tmp_path):
    (tmp_path / "notes.txt").write_text("not data")
    with pytest.raises(DataError, match="no parquet files"):
        list_files(str(tmp_path))


def test_list_files_corrupt_parquet_names_the_file(tmp_path):
    write_digit_like(tmp_path / "a.parquet", list(range(5)))
    (tmp_path / "bad.parquet").write_bytes(b"this is not parquet at all")
    with pytest.raises(DataError, match="bad.parquet"):
        list_files(str(tmp_path))


def test_list_files_single_non_parquet_file_names_it(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("example_id,label\n1,2\n")
    with pytest.raises(DataError, match="rows.csv"):
        list_files(str(path))
