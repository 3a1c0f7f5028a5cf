"""A classifier's label outside 0..num_classes-1 is a data error naming the file, the label
column and the row (counted from 0 in the file), raised by the loader at once (data errors are
not retried), not an IndexError of the loss inside the trial."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from service.core.errors import DataError
from service.data.files import list_files
from service.data.loader import TrainStream, eval_batches
from service.data.sharding import row_ranges
from tests.helpers import contract_workloads as cw


def write_with_label(tmp_path, row: int, label: int) -> str:
    cw.write_tabular_data(str(tmp_path / "d"))
    path = tmp_path / "d" / "validation" / "part-001.parquet"
    table = pq.read_table(path)
    labels = table.column("y").to_pylist()
    labels[row] = label
    pq.write_table(
        table.set_column(table.schema.get_field_index("y"), "y", pa.array(labels, pa.int64())),
        path,
        row_group_size=64,
    )
    return str(path)


@pytest.mark.parametrize("label", [3, -1])
def test_a_label_that_is_no_class_names_the_file_column_and_row(tmp_path, label):
    path = write_with_label(tmp_path, 70, label)  # the second row group of the second file
    ranges = row_ranges(list_files(str(tmp_path / "d" / "validation")), 0, 1)
    with pytest.raises(DataError) as e:
        list(eval_batches(cw.TabularMLP(), ranges, 32))
    assert str(e.value) == (
        f"{path}: column 'y', row 70: label {label} is not a class of workload tabular_mlp "
        "(num_classes 3: 0 to 2)"
    )
    stream = TrainStream(cw.TabularMLP(), ranges, 256, data_seed=0)
    with pytest.raises(DataError, match=rf"column 'y', row 70: label {label} is not a class"):
        stream.batch(0)


def test_labels_of_every_class_pass(tmp_path):
    write_with_label(tmp_path, 70, 2)
    ranges = row_ranges(list_files(str(tmp_path / "d" / "validation")), 0, 1)
    assert sum(len(b["label"]) for b in eval_batches(cw.TabularMLP(), ranges, 32)) == 256
