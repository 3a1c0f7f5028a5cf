"""Write the tabular example's data as parquet shards, by hand (pyarrow only, no playbook):
`python write_data.py DEST` -> DEST/{train,validation,test}/part-*.parquet.

Three classes, each a Gaussian blob in 6 dimensions; `row_id` numbers the rows of all splits
from 1000 on (ids need not be positions), `y` is the class.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

NUM_FEATURES = 6
SPLITS = {"train": (4, 768), "validation": (2, 256), "test": (2, 256)}
"""split -> (files, rows)."""
CENTERS = np.random.default_rng(7).normal(0.0, 1.5, size=(3, NUM_FEATURES))
"""Each class's mean."""


def split_table(rng: np.random.Generator, rows: int, first_id: int) -> pa.Table:
    y = rng.integers(0, 3, size=rows)
    x = CENTERS[y] + rng.normal(0.0, 1.0, size=(rows, NUM_FEATURES))
    columns = {"row_id": pa.array(np.arange(first_id, first_id + rows), pa.int64())}
    columns.update({f"f{i}": pa.array(x[:, i].astype(np.float32)) for i in range(NUM_FEATURES)})
    columns["y"] = pa.array(y.astype(np.int64))
    return pa.table(columns)


def write(dest: str, seed: int = 0) -> dict[str, list[str]]:
    rng = np.random.default_rng(seed)
    written, next_id = {}, 1000
    for split, (files, rows) in SPLITS.items():
        table = split_table(rng, rows, next_id)
        next_id += rows
        os.makedirs(os.path.join(dest, split), exist_ok=True)
        per_file = rows // files
        written[split] = []
        for i in range(files):
            path = os.path.join(dest, split, f"part-{i:03d}.parquet")
            pq.write_table(table.slice(i * per_file, per_file), path, row_group_size=64)
            written[split].append(path)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python write_data.py DEST")
    for split, paths in write(sys.argv[1]).items():
        print(f"{split}: {len(paths)} files under {os.path.join(sys.argv[1], split)}")
