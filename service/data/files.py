"""Listing a split's parquet files and reading their row counts (footer only, no data)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from service.core import storage
from service.core.errors import DataError, SpecError, StorageError

KINDS = ("integer", "floating", "numeric", "boolean", "string", "binary")
"""The type kinds a workload's `column_types` names (and "list<KIND>")."""


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
            raise unreadable(full, e) from None
        files.append(DataFile(full, rows))
    return files


def is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def unreadable(uri: str, e: Exception) -> DataError | StorageError:
    """A failed read of a data file as the error a trial acts on: a DataError (the same on
    every try: the trial fails at once) for a file that is not parquet or is corrupt, or for
    any failure of a local file; a StorageError (retried) for an I/O failure of remote
    storage, which may be transient (Arrow reports a corrupt page as an OSError too, so a
    corrupt remote file is retried before it fails)."""
    if isinstance(e, pa.ArrowException) or is_local(uri):
        return DataError(f"{uri}: not a readable parquet file ({e})")
    return StorageError(f"{uri}: cannot read it ({e})")


def type_kind(t: pa.DataType) -> str:
    """A parquet column's Arrow type as a kind of `KINDS` (or list<KIND>, or the type itself)."""
    if pa.types.is_integer(t):
        return "integer"
    if pa.types.is_floating(t):
        return "floating"
    if pa.types.is_boolean(t):
        return "boolean"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return "binary"
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return f"list<{type_kind(t.value_type)}>"
    return str(t)


def kind_matches(declared: str, kind: str) -> bool:
    if declared.startswith("list<") and kind.startswith("list<"):
        return kind_matches(declared[5:-1], kind[5:-1])
    return kind == declared or (declared == "numeric" and kind in ("integer", "floating"))


def check_declared_kinds(workload) -> None:
    """The workload's `column_types` name its own columns and known kinds."""
    for column, declared in workload.column_types.items():
        inner = declared
        while inner.startswith("list<") and inner.endswith(">"):
            inner = inner[5:-1]
        if column not in workload.columns or inner not in KINDS:
            raise SpecError(
                f"workload: {workload.name}.column_types[{column!r}] = {declared!r}: "
                + (
                    f"not one of its columns ({', '.join(workload.columns)})"
                    if column not in workload.columns
                    else f"not a kind ({', '.join(KINDS)}, or list<KIND>)"
                )
            )


def check_column_types(uri: str, schema: pa.Schema, workload) -> None:
    """Each column the workload declares in `column_types` has that kind in this file's schema
    (footer only: every value of a parquet column has the column's type)."""
    for column, declared in workload.column_types.items():
        if column not in schema.names:
            continue  # a missing column is named by the caller's own check
        t = schema.field(column).type
        if not kind_matches(declared, type_kind(t)):
            raise DataError(
                f"{uri}: column {column!r} is {t} ({type_kind(t)}), but workload {workload.name} "
                f"declares it {declared} (column_types)"
            )


# Every data file this process opened, in order (the trial metadata reports them per rank).
OPENED: list[str] = []
FOOTERS_KEPT = 128
"""Parsed footers a reader keeps (the most recently used files'): a window reopens its files
without reading their footers again."""


class ParquetReader:
    """Reads row groups, projecting `columns` at read time (the column chunks of other columns
    are never fetched or decoded). Each read opens the file on its own, with the footer parsed
    once and cached, so reads of several files can run on several threads at once. Every file
    must give each column the type the first file gave it (a schema mismatch names the file
    and the column)."""

    def __init__(self, columns: tuple[str, ...], workload=None):
        self.columns = columns
        self.workload = workload
        """Checks each file's types against the workload's `column_types` when given."""
        self.expected: dict[str, tuple[pa.DataType, str]] = {}
        self._footers: OrderedDict[str, pq.FileMetaData] = OrderedDict()
        self._lock = threading.Lock()

    def _footer(self, uri: str) -> pq.FileMetaData:
        # Under the lock: the threads reading a window's row groups of one file at once read
        # its footer once.
        with self._lock:
            if uri in self._footers:
                self._footers.move_to_end(uri)
                return self._footers[uri]
            with self._open(uri, None) as pf:
                footer = pf.metadata
            self._check_schema(uri, footer.schema.to_arrow_schema())
            self._footers[uri] = footer
            if len(self._footers) > FOOTERS_KEPT:
                self._footers.popitem(last=False)
            OPENED.append(uri)
            return footer

    @contextmanager
    def _open(self, uri: str, footer: pq.FileMetaData | None) -> Iterator[pq.ParquetFile]:
        fs, path = storage.split(uri)
        try:
            # Local files through pyarrow's own file (a window decodes faster than through a
            # Python file object, docs/performance.md), memory-mapped: the decoder reads the
            # column chunks in place, where a read copies them from the page cache into a
            # buffer first (on Arrow's I/O threads; pre-buffering costs that copy too). A file
            # is mapped for one read: one cut short during that read ends the process (SIGBUS)
            # where a read would raise an error naming it. Any other storage through fsspec,
            # read on the calling thread (see `read_row_group`).
            local = is_local(uri)
            source = path if local else fs.open(path, "rb")
            pf = pq.ParquetFile(source, metadata=footer, memory_map=local)
        except (OSError, pa.ArrowException) as e:
            raise unreadable(uri, e) from None
        try:
            yield pf
        finally:
            pf.close(force=True)

    def _check_schema(self, uri: str, schema: pa.Schema) -> None:
        for c in self.columns:
            if c not in schema.names:
                raise DataError(f"{uri}: missing column {c!r} (has: {', '.join(schema.names)})")
            got = schema.field(c).type
            want = self.expected.setdefault(c, (got, uri))
            if got != want[0]:
                raise DataError(f"{uri}: column {c!r} has type {got}, expected {want[0]} (as in {want[1]})")
        if self.workload is not None:
            check_column_types(uri, schema, self.workload)

    def row_group_sizes(self, uri: str) -> list[int]:
        """Rows per row group (footer only)."""
        md = self._footer(uri)
        return [md.row_group(i).num_rows for i in range(md.num_row_groups)]

    def row_group_bytes(self, uri: str) -> list[int]:
        """Per row group, the uncompressed bytes of the columns read (footer only)."""
        md = self._footer(uri)
        read = [j for j in range(md.num_columns) if md.schema.column(j).path.split(".")[0] in self.columns]
        groups = [md.row_group(i) for i in range(md.num_row_groups)]
        return [sum(g.column(j).total_uncompressed_size for j in read) for g in groups]

    def read_row_group(self, uri: str, index: int, threads: bool = False) -> pa.Table:
        """One row group's columns, decoded on the calling thread, or with `threads` on Arrow's
        threads too (a local file only: the loader reads several row groups at once on its own
        threads, where Arrow's would only compete with them). A file read through a Python file
        object (fsspec: any but a local file; likewise Python bytes in a BytesIO) never uses
        Arrow's threads: the buffers it returns are Python objects, and an Arrow pool thread
        that drops the last reference to one must take the GIL, which kills that thread
        (std::terminate: `terminate called without an active exception`, exit 134) when the
        interpreter is exiting by then."""
        with self._open(uri, self._footer(uri)) as pf:
            try:
                columns, threads = list(self.columns), threads and is_local(uri)
                return pf.read_row_group(index, columns=columns, use_threads=threads)
            except (OSError, pa.ArrowException) as e:
                bad = self._bad_column(pf, index)
                error = unreadable(uri, e)
                raise type(error)(f"{uri}: {bad}cannot read row group {index} ({e})") from None

    def _bad_column(self, pf: pq.ParquetFile, index: int) -> str:
        """Which declared column fails to decode (read one at a time), as an error prefix."""
        for c in self.columns:
            try:
                pf.read_row_group(index, columns=[c], use_threads=False)
            except (OSError, pa.ArrowException):
                return f"column {c!r}: "
        return ""
