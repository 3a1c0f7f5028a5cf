"""A table of rows (dicts) as the two files people and programs read: `<name>.parquet` and
`<name>.csv`, each written whole (readers see the old or the new table, never a torn one)."""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from service.core import storage


def columns(rows: Sequence[Mapping[str, Any]], first: Iterable[str]) -> dict[str, list]:
    """The rows column by column: the `first` columns in their order, then every other key of
    any row, sorted; a row without a key has None there. The lists hold references to the
    rows' values (no copy of a row)."""
    first = list(first)
    names = first + sorted({k for r in rows for k in r} - set(first))
    return {k: [r.get(k) for r in rows] for k in names}


def read_parquet(data: bytes) -> pa.Table:
    """A parquet file's bytes as a table, decoded on this thread. Not `pq.read_table`: its
    dataset reader hands work to Arrow's threads even with use_threads=False, and a process that
    exits soon after (a one-line refusal, exit 2) then dies in one of them at the interpreter's
    exit (`terminate called without an active exception`, exit 134; seen once torch is loaded)."""
    return pq.ParquetFile(io.BytesIO(data), pre_buffer=False).read(use_threads=False)


def write_parquet_csv(table: pa.Table, parquet_uri: str, csv_uri: str) -> None:
    """Write `table` (e.g. `pa.table(columns(...))`) as parquet and as CSV."""
    buf = io.BytesIO()
    pq.write_table(table, buf)
    storage.write_bytes_atomic(parquet_uri, buf.getvalue())
    csv = io.BytesIO()
    pacsv.write_csv(table, csv)
    storage.write_bytes_atomic(csv_uri, csv.getvalue())
