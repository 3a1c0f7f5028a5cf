"""Built-in workloads: digits columns to tensors, and 'is it a zero?' as a 1:9 imbalanced task."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
from sklearn.datasets import load_digits

from service import workloads


def test_digits_batches_are_the_sklearn_images(digits_dir):
    table = pq.read_table(str(digits_dir / "train"))
    batch = workloads.get("digits").to_batch(table)
    ref = load_digits()
    ids = table.column("example_id").to_numpy()
    np.testing.assert_allclose(
        batch["features"].reshape(len(ids), 64).numpy(), ref.data[ids] / 16.0, rtol=1e-6
    )
    np.testing.assert_array_equal(batch["label"].numpy(), ref.target[ids])


def test_digits_zero_is_the_imbalanced_binary_task(digits_dir):
    table = pq.read_table(str(digits_dir / "validation"))
    batch = workloads.get("digits_zero").to_batch(table)
    digits = table.column("label").to_numpy()
    np.testing.assert_array_equal(batch["label"].numpy(), (digits == 0).astype(np.int64))
    positives = int(batch["label"].sum())
    assert 0 < positives < len(digits) / 5  # about 1 in 10
    model = workloads.get("digits_zero").build_model({"width": 4})
    assert model(batch["features"][:3]).shape == (3, 2)
