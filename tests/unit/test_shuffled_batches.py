"""`batches.Shuffled`: a window's rows served in a given order, a batch at a time."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from service.data.batches import Shuffled


@pytest.mark.parametrize("features_dtype", [torch.float32, torch.bfloat16])
def test_a_batch_is_the_rows_of_its_slice_of_the_order(features_dtype):
    # bfloat16 has no numpy dtype: that window is gathered by torch, the other by numpy alone.
    n = 50
    tensors = {
        "features": torch.arange(n * 4, dtype=torch.float32).reshape(n, 1, 2, 2).to(features_dtype),
        "label": torch.arange(n) % 7,
        "example_id": torch.arange(100, 100 + n),
    }
    order = np.random.default_rng(0).permutation(n)
    window = Shuffled(tensors, order)
    assert len(window) == n
    for lo, hi in ((0, 16), (16, 32), (45, 50)):
        batch = window.take(lo, hi)
        assert list(batch) == list(tensors)
        for k, v in tensors.items():
            expected = torch.stack([v[int(i)] for i in order[lo:hi]])  # row by row
            assert batch[k].dtype == v.dtype and batch[k].is_contiguous()
            assert torch.equal(batch[k], expected)
