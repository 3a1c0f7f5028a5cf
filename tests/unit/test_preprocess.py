"""`playbook preprocess`: raw parquet -> the workload's declared columns in mixed, sized shards,
with a provenance record that `playbook run` copies into the study."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from service import cli
from service.data.files import list_files
from service.data.loader import TrainStream
from service.data.preprocess import PROVENANCE_FILE, record_in_study
from service.data.sharding import RowRange
from tests.helpers import input_workloads
from tests.helpers.studies import make_study

WORKLOAD = f"{input_workloads.__name__}:RawDigits"


def write_raw(directory, num_files=3, rows_per_file=300) -> dict[int, tuple[np.ndarray, int]]:
    """Raw files sorted by label (the worst order for a windowed shuffle); returns id -> (raw, label)."""
    directory.mkdir()
    rng = np.random.default_rng(0)
    truth = {}
    labels = np.sort(rng.integers(0, 10, num_files * rows_per_file))
    for j in range(num_files):
        ids = np.arange(j * rows_per_file, (j + 1) * rows_per_file)
        raw = rng.integers(0, 17, (rows_per_file, 64)).astype(np.int16)
        table = pa.table(
            {
                "example_id": pa.array(ids),
                "raw": pa.FixedSizeListArray.from_arrays(pa.array(raw.reshape(-1)), 64),
                "label": pa.array(labels[ids]),
                "notes": pa.array(["free text"] * rows_per_file),
            }
        )
        pq.write_table(table, directory / f"raw-{j}.parquet", row_group_size=100)
        truth.update({int(i): (raw[k], int(labels[i])) for k, i in enumerate(ids)})
    return truth


def test_preprocess_writes_declared_columns_in_mixed_shards_with_provenance(tmp_path, capsys):
    truth = write_raw(tmp_path / "raw")
    out = tmp_path / "prep"
    code = cli.main(
        [
            "preprocess",
            str(tmp_path / "raw"),
            str(out),
            "--workload",
            WORKLOAD,
            "--num-files",
            "4",
            "--row-group-size",
            "64",
            "--seed",
            "1",
        ]
    )
    assert code == 0
    assert "900 rows of 3 files into 4 shards" in capsys.readouterr().out

    files = list_files(str(out))
    assert len(files) == 4
    seen = {}
    for f in files:
        pf = pq.ParquetFile(f.uri)
        assert pf.schema_arrow.names == ["example_id", "pixels", "label"]  # declared columns only
        assert all(pf.metadata.row_group(g).num_rows == 64 for g in range(pf.num_row_groups - 1))
        t = pf.read()
        ids = t.column("example_id").to_pylist()
        # every shard mixes rows of every raw file (and so of every label range)
        assert {i // 300 for i in ids} == {0, 1, 2}
        for i, px, label in zip(
            ids, t.column("pixels").to_pylist(), t.column("label").to_pylist(), strict=True
        ):
            raw, want_label = truth[i]
            np.testing.assert_array_equal(np.asarray(px, np.float32), (raw / 16.0).astype(np.float32))
            assert label == want_label
            seen[i] = True
    assert sorted(seen) == sorted(truth)  # every row exactly once (ids are unique per shard)

    record = json.loads((out / PROVENANCE_FILE).read_text())
    assert record["source"] == str(tmp_path / "raw")
    assert [f["num_rows"] for f in record["source_files"]] == [300, 300, 300]
    assert record["workload"] == "raw_digits" and record["workload_class"].endswith(":RawDigits")
    assert record["num_rows"] == 900
    assert sorted(f["num_rows"] for f in record["files"]) == sorted(f.num_rows for f in files)
    assert record["code_version"] is None or len(record["code_version"]) == 40

    # The shards feed the streaming loader directly.
    stream = TrainStream(input_workloads.RawDigits(), [RowRange(f, 0, f.num_rows) for f in files], 50, 0)
    assert stream.num_examples == 900 and len(stream.batch(17)["label"]) == 50


def test_a_study_on_preprocessed_data_records_its_provenance(tmp_path, digits_dir):
    write_raw(tmp_path / "raw")
    cli.main(["preprocess", str(tmp_path / "raw"), str(tmp_path / "prep"), "--workload", WORKLOAD])
    study = make_study(digits_dir, tmp_path / "studies", workload="digits")
    import dataclasses

    study = dataclasses.replace(study, data=dataclasses.replace(study.data, train=str(tmp_path / "prep")))
    lines = record_in_study(study)
    assert lines[0].startswith("data: 900 rows preprocessed by workload raw_digits from")
    assert "preprocessed for workload raw_digits, not digits" in lines[1]
    stored = json.loads((tmp_path / "studies" / study.name / "data_provenance.json").read_text())
    assert stored["num_rows"] == 900
    assert record_in_study(make_study(digits_dir, tmp_path / "s2")) == []  # digits: not preprocessed


def test_preprocess_missing_column_is_named(tmp_path):
    write_raw(tmp_path / "raw")
    from service.core.errors import DataError
    from service.data.preprocess import preprocess
    from service.workloads.digits import Digits

    with pytest.raises(DataError, match=r"raw-0\.parquet: workload digits cannot preprocess it .*pixels"):
        preprocess(Digits(), str(tmp_path / "raw"), str(tmp_path / "out"))


def test_a_failure_half_way_leaves_no_shard_and_no_record(tmp_path):
    """Shards are streamed out while the input is read: a bad last file must not leave the
    shards written so far (nor a provenance record) behind."""
    from service.core.errors import DataError
    from service.data.preprocess import preprocess

    write_raw(tmp_path / "raw", rows_per_file=3000)
    bad = pq.read_table(tmp_path / "raw" / "raw-2.parquet").drop_columns(["raw"])
    pq.write_table(bad, tmp_path / "raw" / "raw-2.parquet")
    with pytest.raises(DataError, match=r"raw-2\.parquet: workload raw_digits cannot preprocess it"):
        preprocess(input_workloads.RawDigits(), str(tmp_path / "raw"), str(tmp_path / "out"), 4, 100)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []


PREPROCESS_PEAK = """
import json, sys, tracemalloc
sys.path.insert(0, "tests")
import pyarrow as pa
from service.data.preprocess import preprocess
from service.workloads import get
tracemalloc.start()
preprocess(get(sys.argv[1]), sys.argv[2], sys.argv[3], num_files=4, row_group_size=1000)
python_peak = tracemalloc.get_traced_memory()[1]
print(json.dumps({"peak": python_peak + pa.default_memory_pool().max_memory()}))
"""


def test_preprocess_memory_does_not_grow_with_the_output(tmp_path):
    """Shards stream to storage as they grow: preprocessing 10x the rows raises the peak of
    Python's and Arrow's allocations by a small fraction of the extra bytes written."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    growth, written = {}, {}
    for name, rows_per_file in {"small": 6_000, "large": 60_000}.items():
        write_raw(tmp_path / name, num_files=3, rows_per_file=rows_per_file)
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                PREPROCESS_PEAK,
                WORKLOAD,
                str(tmp_path / name),
                str(tmp_path / f"{name}-out"),
            ],
            capture_output=True,
            text=True,
            check=True,
            cwd=root,
        )
        growth[name] = json.loads(out.stdout.strip().splitlines()[-1])["peak"]
        outputs = list_files(str(tmp_path / f"{name}-out"))
        assert sum(f.num_rows for f in outputs) == 3 * rows_per_file
        written[name] = sum(os.path.getsize(f.uri) for f in outputs)
    more_output = written["large"] - written["small"]  # bytes of parquet the 10x run wrote more
    print("preprocess peak allocations", growth, "more output bytes", more_output)
    assert growth["large"] - growth["small"] < more_output / 5
