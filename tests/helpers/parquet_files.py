"""Damaging parquet files on purpose."""

from __future__ import annotations

import pyarrow.parquet as pq


def corrupt_column(path, column: str) -> None:
    """Overwrite every column chunk of `column` with 0xff bytes (page headers included)."""
    md = pq.read_metadata(path)
    raw = bytearray(open(path, "rb").read())
    index = md.schema.to_arrow_schema().names.index(column)
    for rg in range(md.num_row_groups):
        chunk = md.row_group(rg).column(index)
        start = chunk.dictionary_page_offset or chunk.data_page_offset
        raw[start : start + chunk.total_compressed_size] = b"\xff" * chunk.total_compressed_size
    with open(path, "wb") as f:
        f.write(raw)
