"""Listing a split's parquet files and reading their row counts (footer only, no data)."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from service import storage
from service.errors import DataError


@dataclass(frozen=True)
class DataFile:
    uri: str
    num_rows: int


def list_files(uri: str) -> list[DataFile]:
    """The parquet files under `uri` (a directory, a glob or one file), sorted, with row counts."""
    fs, path = storage.split(uri)
    protocol = uri.split("://", 1)[0] + "://" if "://" in uri else ""
    try:
        if any(c in path for c in "*?["):
            paths = sorted(fs.glob(path))
        elif fs.isdir(path):
            paths = sorted(p for p in fs.find(path) if p.endswith(".parquet"))
        elif fs.exists(path):
            paths = [path]
        else:
            raise DataError(f"{uri}: no such file or directory")
    except OSError as e:
        raise DataError(f"{uri}: cannot list ({e})") from None
    if not paths:
        raise DataError(f"{uri}: no parquet files found")
    files = []
    for p in paths:
        full = p if not protocol or p.startswith(protocol) else protocol + p
        try:
            with fs.open(p, "rb") as f:
                rows = pq.ParquetFile(f).metadata.num_rows
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"{full}: not a readable parquet file ({e})") from None
        files.append(DataFile(full, rows))
    return files


# Every data file this process opened, in order (the trial metadata reports them per rank).
OPENED: list[str] = []


def read_columns(file: DataFile, columns: tuple[str, ...]) -> pa.Table:
    """Read only `columns` of one file (projection at read time)."""
    OPENED.append(file.uri)
    fs, path = storage.split(file.uri)
    try:
        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            missing = [c for c in columns if c not in pf.schema_arrow.names]
            if missing:
                raise DataError(
                    f"{file.uri}: missing column {missing[0]!r} (has: {', '.join(pf.schema_arrow.names)})"
                )
            return pf.read(columns=list(columns))
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{file.uri}: cannot read ({e})") from None
