"""`playbook data digits URI`: scikit-learn's bundled digits written once, offline, as parquet
shards: train / validation / test, several files each, pixels pre-scaled to [0, 1]."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from service.core import storage

SPLITS = {"train": 0.7, "validation": 0.15, "test": 0.15}
FILES_PER_SPLIT = {"train": 4, "validation": 2, "test": 2}


def digits_table() -> pa.Table:
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = (digits.data / 16.0).astype(np.float32)
    return pa.table(
        {
            "example_id": pa.array(np.arange(len(pixels)), pa.int64()),
            "pixels": pa.FixedSizeListArray.from_arrays(pa.array(pixels.reshape(-1)), 64),
            "label": pa.array(digits.target.astype(np.int64)),
        }
    )


def write_digits(uri: str, seed: int = 0) -> dict[str, list[str]]:
    """Shuffle once with `seed`, split 70/15/15, write each split as several parquet files.
    Returns the written file URIs by split."""
    table = digits_table()
    order = np.random.default_rng(seed).permutation(table.num_rows)
    bounds = np.cumsum([0] + [int(round(f * table.num_rows)) for f in SPLITS.values()])
    bounds[-1] = table.num_rows
    written: dict[str, list[str]] = {}
    for i, split in enumerate(SPLITS):
        rows = np.sort(order[bounds[i] : bounds[i + 1]])
        part = table.take(pa.array(rows))
        written[split] = []
        for j, chunk in enumerate(np.array_split(np.arange(part.num_rows), FILES_PER_SPLIT[split])):
            buf = io.BytesIO()
            pq.write_table(part.take(pa.array(chunk)), buf, row_group_size=128)
            file_uri = storage.join(uri, split, f"part-{j:05d}.parquet")
            storage.write_bytes_atomic(file_uri, buf.getvalue())
            written[split].append(file_uri)
    return written
