"""Training examples that are also in the validation or test split, by example id.

The playbook counts train/test overlap among the implementation bugs that periodic evals help
find; the ids say it before any trial runs. A split of at most `EXACT_ROWS` rows has every id
read and the count is exact; a larger one has a seeded sample of its row groups read (about
`SAMPLE_ROWS` rows), and the count is estimated: an evaluation example whose id is in the
training split is found with probability (training rows read / training rows) x (its split's
rows read / its rows), so the hits are divided by that product."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq

from service.core import storage
from service.data.files import DataFile

EXACT_ROWS = 2_000_000
"""A split with at most this many rows has all its ids read."""
SAMPLE_ROWS = 500_000
"""Rows of a larger split read, as whole row groups drawn with a fixed seed."""
SEED = 0


@dataclass(frozen=True)
class SplitIds:
    ids: np.ndarray
    rows_read: int
    rows: int

    @property
    def fraction(self) -> float:
        return self.rows_read / self.rows if self.rows else 1.0

    @property
    def exact(self) -> bool:
        return self.rows_read == self.rows


@dataclass(frozen=True)
class Overlap:
    count: float
    """Examples of the evaluation split whose id is in the training split (estimated when
    either split was sampled)."""
    train: SplitIds
    other: SplitIds

    @property
    def exact(self) -> bool:
        return self.train.exact and self.other.exact

    def describe(self, split: str, id_column: str) -> str:
        if self.exact:
            return (
                f"{int(self.count):,} of {self.other.rows:,} {split} examples have an {id_column} "
                "that is also in the training split"
            )
        return (
            f"about {self.count:,.0f} of {self.other.rows:,} {split} examples have an {id_column} "
            f"that is also in the training split (estimated from the ids of {self.train.rows_read:,} "
            f"of {self.train.rows:,} training and {self.other.rows_read:,} of {self.other.rows:,} "
            f"{split} rows)"
        )


def read_ids(files: list[DataFile], column: str) -> SplitIds:
    """The split's ids: all of them, or those of a seeded sample of its row groups when it has
    more than `EXACT_ROWS` rows."""
    rows = sum(f.num_rows for f in files)
    if rows <= EXACT_ROWS:
        return SplitIds(_concat([_read(f.uri, column) for f in files]), rows, rows)
    groups = []  # (uri, row group, rows)
    for f in files:
        with _open(f.uri) as pf:
            groups += [(f.uri, i, pf.metadata.row_group(i).num_rows) for i in range(pf.num_row_groups)]
    taken, total = [], 0
    for i in np.random.default_rng(SEED).permutation(len(groups)):
        if total >= SAMPLE_ROWS:
            break
        taken.append(groups[i])
        total += groups[i][2]
    by_file: dict[str, list[int]] = {}
    for uri, group, _ in sorted(taken):
        by_file.setdefault(uri, []).append(group)
    ids = _concat([_read(uri, column, wanted) for uri, wanted in by_file.items()])
    return SplitIds(ids, len(ids), rows)


def overlap(train: SplitIds, other: SplitIds) -> Overlap:
    hits = int(np.isin(other.ids, train.ids).sum())
    return Overlap(hits / (train.fraction * other.fraction), train, other)


def _read(uri: str, column: str, row_groups: list[int] | None = None) -> np.ndarray:
    with _open(uri) as pf:
        if row_groups is None:
            table = pf.read(columns=[column], use_threads=False)
        else:
            table = pf.read_row_groups(row_groups, [column], use_threads=False)
    return table.column(column).to_numpy()


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


@contextmanager
def _open(uri: str) -> Iterator[pq.ParquetFile]:
    fs, path = storage.split(uri)
    with fs.open(path, "rb") as fh:
        yield pq.ParquetFile(fh, pre_buffer=False)  # read on this thread: see files.ParquetReader
