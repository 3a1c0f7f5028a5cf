"""Pad partial eval batches with zero-weight rows so every batch has the same shape.

The playbook (and init2winit's `maybe_pad_batch`) pads the last, short eval batch instead of
dropping it or running a smaller one: every batch then has one static shape (compiled models,
collective ops that expect equal counts) and metrics stay exact because padded rows carry
weight 0 and are ignored by `service.evaluation.metrics.WeightedSums`.
"""

from __future__ import annotations

import torch
from torch import Tensor

PAD_VALUES = {"example_id": -1}
"""Fill value per key for padded rows; every other key (labels, features) is padded with 0."""


def pad_batch(batch: dict[str, Tensor], size: int) -> dict[str, Tensor]:
    """`batch` with every tensor padded along dim 0 to `size` rows, plus a float "weight" tensor:
    1 for real rows (or the batch's own "weight", if it has one) and 0 for padded rows.

    Padded rows are zeros, except "example_id" which is -1 (no real example has that id).
    Raises ValueError when the batch is empty of tensors, its tensors disagree on the number of
    rows, or it has more than `size` rows.
    """
    if not batch:
        raise ValueError("pad_batch: the batch has no tensors")
    rows = {len(v) for v in batch.values()}
    if len(rows) != 1:
        raise ValueError(f"pad_batch: tensors disagree on the number of rows: {sorted(rows)}")
    n = rows.pop()
    if n > size:
        raise ValueError(f"pad_batch: batch of {n} rows is larger than the eval batch size {size}")
    reference = next(iter(batch.values()))
    weight = batch.get("weight")
    if weight is None:
        weight = torch.ones(n, dtype=torch.float32, device=reference.device)
    padded = {k: _pad(v, size - n, PAD_VALUES.get(k, 0)) for k, v in batch.items() if k != "weight"}
    padded["weight"] = _pad(weight, size - n, 0)
    return padded


def _pad(t: Tensor, missing: int, fill: int) -> Tensor:
    if missing == 0:
        return t
    return torch.cat([t, t.new_full((missing, *t.shape[1:]), fill)])
