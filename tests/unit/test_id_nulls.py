"""An id column with nulls is refused before anything starts (`validate --data`, `run`'s
pre-flight), naming the file and the column, not by the loader inside every trial."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from service.core.errors import DataError
from service.study import spec
from service.study.checks import check_data
from tests.helpers import contract_workloads as cw


def test_a_null_id_past_the_first_rows_is_refused_before_anything_starts(tmp_path):
    cw.write_tabular_data(str(tmp_path / "d"))
    path = tmp_path / "d" / "train" / "part-002.parquet"  # not the first file, a null in its 2nd row group
    table = pq.read_table(path)
    ids = table.column("row_id").to_pylist()
    ids[100] = None
    pq.write_table(table.set_column(0, "row_id", pa.array(ids, pa.int64())), path, row_group_size=64)
    with open(os.path.join(cw.STUDY_DIR, "study.yaml")) as f:
        d = yaml.safe_load(f)
    d["workload"] = "tests.helpers.contract_workloads:TabularMLP"
    d["data"] = {s: str(tmp_path / "d" / s) for s in ("train", "validation", "test")}
    d["storage"] = str(tmp_path / "studies")
    with pytest.raises(DataError) as e:
        check_data(spec.load_dict(d))
    assert str(e.value) == (
        f"data.train: {path}: column 'row_id' (id_column of workload tabular_mlp) has 1 null(s); "
        "ids must be integers"
    )
    assert not (tmp_path / "studies").exists()
