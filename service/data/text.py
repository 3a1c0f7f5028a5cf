"""`playbook data text URI`: a byte-level corpus from text every machine has, the Python standard
library's `.py` sources, written once, offline, as parquet shards for the `lm` workload.

Files are split into train / validation **by file** (a hash of each file's path relative to the
standard library, so the same file lands in the same split on every machine) and each file is
cut into sequences of `seq_len` bytes. Every byte of every file is the target of exactly one
sequence position: a row holds its target bytes (`bytes`, zero-padded to `seq_len`), the byte
before them (`context`: `BOS` for a file's first sequence, else the last byte of the previous
one) and how many of its positions are real (`num_tokens`; a file's last sequence is shorter and
its padding has weight 0). Files are never glued together nor dropped once chosen; with
`max_bytes`, each split takes whole files in hash order while they fit in its share (90 % /
10 %).
"""

from __future__ import annotations

import hashlib
import io
import os
import sysconfig
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from service.core import storage
from service.core.errors import DataError

BOS = 256
"""The token before a file's first byte (bytes are 0-255): a vocabulary of 257."""
VALIDATION_PERCENT = 10
SHARES = {"train": 1 - VALIDATION_PERCENT / 100, "validation": VALIDATION_PERCENT / 100}
"""Each split's share of `max_bytes`."""
FILES_PER_SPLIT = {"train": 4, "validation": 2}
ROW_GROUP_SIZE = 256
SKIPPED_DIRS = ("site-packages", "dist-packages", "__pycache__")


@dataclass(frozen=True)
class SourceFile:
    relpath: str  # relative to the standard library's folder, "/"-separated
    path: str

    @property
    def digest(self) -> int:
        return int.from_bytes(hashlib.sha256(self.relpath.encode()).digest()[:8], "big")

    @property
    def split(self) -> str:
        return "validation" if self.digest % 100 < VALIDATION_PERCENT else "train"


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def source_files(root: str) -> list[SourceFile]:
    """Every `.py` file under `root` (installed packages and caches left out), in hash order."""
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                found.append(SourceFile(os.path.relpath(path, root).replace(os.sep, "/"), path))
    return sorted(found, key=lambda f: (f.digest, f.relpath))


def choose(files: list[SourceFile], max_bytes: int | None) -> list[tuple[SourceFile, bytes]]:
    """The files' contents, in the given order; with `max_bytes`, whole files while they fit
    (one that does not fit is passed over, the next may still fit)."""
    chosen, total = [], 0
    for f in files:
        with open(f.path, "rb") as fh:
            data = fh.read()
        if max_bytes is not None and total + len(data) > max_bytes:
            continue
        chosen.append((f, data))
        total += len(data)
    return chosen


def sequences(data: bytes, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One file's sequences: (targets [k, seq_len] uint8 zero-padded, context [k], num_tokens [k]),
    k = ceil(len / seq_len); no sequence for an empty file."""
    raw = np.frombuffer(data, dtype=np.uint8)
    k = -(-len(raw) // seq_len)
    targets = np.zeros(k * seq_len, dtype=np.uint8)
    targets[: len(raw)] = raw
    targets = targets.reshape(k, seq_len)
    context = np.full(k, BOS, dtype=np.int32)
    context[1:] = targets[:-1, -1]
    num_tokens = np.minimum(seq_len, len(raw) - np.arange(k) * seq_len).astype(np.int32)
    return targets, context, num_tokens


def split_table(chosen: list[tuple[SourceFile, bytes]], seq_len: int, first_id: int = 0) -> pa.Table:
    """The rows of one split's files, in the given order, ids from `first_id`."""
    targets, context, num_tokens, file, chunk = [np.zeros((0, seq_len), np.uint8)], [], [], [], []
    for f, data in chosen:
        t, c, n = sequences(data, seq_len)
        targets.append(t)
        context.append(c)
        num_tokens.append(n)
        file += [f.relpath] * len(t)
        chunk.append(np.arange(len(t), dtype=np.int32))
    targets = np.concatenate(targets)
    n = len(targets)
    data = pa.py_buffer(targets.tobytes())
    return pa.table(
        {
            "example_id": pa.array(np.arange(first_id, first_id + n, dtype=np.int64)),
            "bytes": pa.FixedSizeBinaryArray.from_buffers(pa.binary(seq_len), n, [None, data]),
            "context": pa.array(np.concatenate([np.zeros(0, np.int32), *context])),
            "num_tokens": pa.array(np.concatenate([np.zeros(0, np.int32), *num_tokens])),
            "file": pa.array(file, pa.string()),
            "chunk": pa.array(np.concatenate([np.zeros(0, np.int32), *chunk])),
        }
    )


def write_text(
    uri: str, max_bytes: int | None = None, seq_len: int = 256, root: str | None = None
) -> dict[str, list[str]]:
    """Write the corpus under `uri`/train and `uri`/validation. Returns the written file URIs by
    split. A split with fewer sequences than its files (`max_bytes` too small) is refused before
    anything is written."""
    if seq_len < 1:
        raise DataError(f"--seq-len: must be a positive number of bytes, got {seq_len}")
    if max_bytes is not None and max_bytes < 1:
        raise DataError(f"--max-bytes: must be a positive number of bytes, got {max_bytes}")
    files = source_files(root or stdlib_root())
    tables, first_id = {}, 0
    for split, share in SHARES.items():  # ids run on over the splits: unique in the corpus
        budget = None if max_bytes is None else int(max_bytes * share)
        tables[split] = split_table(choose([f for f in files if f.split == split], budget), seq_len, first_id)
        first_id += tables[split].num_rows
    for split, table in tables.items():
        if table.num_rows < FILES_PER_SPLIT[split]:
            raise DataError(
                f"--max-bytes {max_bytes}: too small, the {split} split would have {table.num_rows} "
                f"sequence(s) for {FILES_PER_SPLIT[split]} files"
            )
    return {s: write_split(uri, s, t) for s, t in tables.items()}


def write_split(uri: str, split: str, table: pa.Table) -> list[str]:
    """A split's rows as FILES_PER_SPLIT[split] parquet files of consecutive rows."""
    written = []
    for j, rows in enumerate(np.array_split(np.arange(table.num_rows), FILES_PER_SPLIT[split])):
        buf = io.BytesIO()
        pq.write_table(table.slice(int(rows[0]), len(rows)), buf, row_group_size=ROW_GROUP_SIZE)
        file_uri = storage.join(uri, split, f"part-{j:05d}.parquet")
        storage.write_bytes_atomic(file_uri, buf.getvalue())
        written.append(file_uri)
    return written


def build(
    uri: str, count: int | None, seed: int, max_bytes: int | None = None, seq_len: int | None = None
) -> dict[str, list[str]]:
    """`playbook data text` (service/data/make.DATASETS): nothing is drawn, so `--seed` changes
    nothing; the size is `--max-bytes`, not `--count`."""
    if count is not None:
        raise DataError("--count: the text corpus is sized in bytes, by --max-bytes")
    return write_text(uri, max_bytes, 256 if seq_len is None else seq_len)
