"""`playbook preprocess`: the workload's preprocessing done once, offline, into parquet shards
the loader streams (the playbook: preprocess offline what need not be done every epoch).

Raw parquet files are streamed one row group at a time through `Workload.preprocess`
(vectorised, raw columns -> exactly the declared columns). Each row goes to one of
`num_files` output shards, drawn with `seed`, so every shard mixes rows from all of the input
(the loader shuffles row groups and rows within a window, so mixed shards matter when the raw
data is sorted). Shards are written in row groups of `row_group_size` rows and streamed to
storage; memory stays at one input row group plus one pending row group (and the storage
client's upload buffer) per shard. Pick `num_files` as a multiple of
the largest host count you will shard over (files are the unit of host sharding).

A provenance record `_provenance.json` is written beside the shards (source files and their
row counts, workload, code version, settings, output files and row counts); `playbook run`
copies it into the study as `data_provenance.json` and prints it.
"""

from __future__ import annotations

import datetime
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from service.core import storage
from service.core.errors import DataError
from service.core.git import git
from service.data.files import list_files
from service.workloads.base import Workload

PROVENANCE_FILE = "_provenance.json"


def code_version() -> str | None:
    """The git commit of the service's source tree (None outside a checkout)."""
    return (
        git(os.path.dirname(os.path.abspath(__file__)), "rev-parse", "HEAD") or b""
    ).decode().strip() or None


class ShardWriter:
    """Parquet shards under `dest`, each written in row groups of `row_group_size` rows and
    streamed to storage as it grows (a shard never sits whole in memory). A local shard is
    written under a temporary name and renamed when it is complete; an object-store upload
    (gcsfs: a resumable upload) becomes visible only when its file is closed."""

    def __init__(self, dest: str, num_files: int, row_group_size: int):
        self.dest, self.row_group_size = dest, row_group_size
        self.pending: list[list[pa.Table]] = [[] for _ in range(num_files)]
        self.files: list = [None] * num_files
        self.writers: list[pq.ParquetWriter | None] = [None] * num_files
        self.rows = [0] * num_files
        self.fs, self.path = storage.split(dest)
        self.local = isinstance(self.fs, LocalFileSystem)
        self.fs.makedirs(self.path, exist_ok=True)

    def uri(self, shard: int) -> str:
        return storage.join(self.dest, f"part-{shard:05d}.parquet")

    def _target(self, shard: int) -> str:
        final = f"{self.path}/part-{shard:05d}.parquet"
        return f"{final}.partial" if self.local else final

    def add(self, shard: int, table: pa.Table) -> None:
        self.pending[shard].append(table)
        if sum(t.num_rows for t in self.pending[shard]) >= self.row_group_size:
            self._flush(shard, final=False)

    def _flush(self, shard: int, final: bool) -> None:
        if not self.pending[shard]:
            return
        table = pa.concat_tables(self.pending[shard])
        keep = table.num_rows if final else table.num_rows - table.num_rows % self.row_group_size
        if self.writers[shard] is None:
            self.files[shard] = self.fs.open(self._target(shard), "wb")
            self.writers[shard] = pq.ParquetWriter(self.files[shard], table.schema)
        self.writers[shard].write_table(table.slice(0, keep), row_group_size=self.row_group_size)
        self.rows[shard] += keep
        self.pending[shard] = [table.slice(keep)] if keep < table.num_rows else []

    def close(self) -> list[dict]:
        """Finish every non-empty shard; returns [{uri, num_rows}]."""
        out = []
        for shard in range(len(self.writers)):
            self._flush(shard, final=True)
            if self.writers[shard] is None:
                continue
            self.writers[shard].close()
            self.files[shard].close()
            if self.local:
                os.replace(self._target(shard), self._target(shard).removesuffix(".partial"))
            out.append({"uri": self.uri(shard), "num_rows": self.rows[shard]})
        return out

    def abort(self) -> None:
        """After a failure: local partial shards are removed (an object upload not closed
        never appears)."""
        for shard, f in enumerate(self.files):
            if f is None:
                continue
            self.writers[shard].close()  # else its finalizer writes into a closed file
            if self.local:
                f.close()
                os.remove(self._target(shard))


def preprocess(
    workload: Workload,
    source: str,
    dest: str,
    num_files: int = 8,
    row_group_size: int = 1024,
    seed: int = 0,
) -> dict:
    """Preprocess every parquet file under `source` into shards under `dest`; returns the
    provenance record (also written to `dest/_provenance.json`)."""
    if num_files <= 0 or row_group_size <= 0:
        raise DataError("preprocess: --num-files and --row-group-size must be > 0")
    inputs = list_files(source)
    writer = ShardWriter(dest, num_files, row_group_size)
    rng = np.random.default_rng(seed)
    try:
        for f in inputs:
            _preprocess_file(workload, f, writer, rng)
    except BaseException:
        writer.abort()
        raise
    outputs = writer.close()
    record = {
        "source": source,
        "source_files": [{"uri": f.uri, "num_rows": f.num_rows} for f in inputs],
        "workload": workload.name or type(workload).__qualname__,
        "workload_class": f"{type(workload).__module__}:{type(workload).__qualname__}",
        "columns": list(workload.columns),
        "code_version": code_version(),
        "seed": seed,
        "row_group_size": row_group_size,
        "num_rows": sum(o["num_rows"] for o in outputs),
        "files": outputs,
        "created_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    storage.write_json(storage.join(dest, PROVENANCE_FILE), record)
    return record


def _preprocess_file(workload: Workload, f, writer: ShardWriter, rng: np.random.Generator) -> None:
    """One raw file, a row group at a time, into the shards (each row to a random shard)."""
    fs, path = storage.split(f.uri)
    with fs.open(path, "rb") as handle:
        pf = pq.ParquetFile(handle, pre_buffer=False)  # read on this thread: see files.ParquetReader
        for g in range(pf.num_row_groups):
            try:
                raw = pf.read_row_group(g, use_threads=False)
            except (OSError, pa.ArrowException) as e:
                raise DataError(f"{f.uri}: cannot read row group {g} ({e})") from None
            try:
                table = workload.preprocess(raw)
            except (KeyError, pa.ArrowException, ValueError, TypeError) as e:
                raise DataError(f"{f.uri}: workload {workload.name} cannot preprocess it ({e})") from None
            missing = [c for c in workload.columns if c not in table.column_names]
            if missing:
                raise DataError(
                    f"{f.uri}: workload {workload.name}'s preprocess gave no column {missing[0]!r}"
                )
            table = table.select(list(workload.columns))
            shard_of = rng.integers(len(writer.rows), size=table.num_rows)
            for shard in np.unique(shard_of):
                writer.add(int(shard), table.filter(pa.array(shard_of == shard)))


def data_provenance(uri: str) -> dict | None:
    """The preprocess record of a data URI (a directory of shards), if it has one."""
    return storage.read_json(storage.join(uri.rstrip("/"), PROVENANCE_FILE))


def record_in_study(study) -> list[str]:
    """Copy the training data's preprocess record into the study (`data_provenance.json`);
    returns the lines to print (none when the data was not made by `playbook preprocess`)."""
    from service import workloads

    record = data_provenance(study.data.train)
    if record is None:
        return []
    storage.write_json(study.layout.data_provenance, record)
    lines = [
        f"data: {record['num_rows']} rows preprocessed by workload {record['workload']} from "
        f"{record['source']} at code version {record['code_version']}"
    ]
    if record["workload"] != workloads.get(study.workload).name:
        lines.append(
            f"warning: the training data was preprocessed for workload {record['workload']}, "
            f"not {study.workload}"
        )
    return lines
