"""Batches for one rank: a seeded, resumable training stream and in-order eval batches."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import torch

from service.data.files import read_columns
from service.data.sharding import RowRange
from service.errors import DataError
from service.workloads.base import Workload


def read_ranges(ranges: list[RowRange], columns: tuple[str, ...]) -> pa.Table:
    tables = [read_columns(r.file, columns).slice(r.start, r.stop - r.start) for r in ranges]
    if not tables:
        raise DataError("this rank's data shard is empty")
    try:
        return pa.concat_tables(tables)
    except pa.ArrowInvalid as e:
        raise DataError(f"{ranges[0].file.uri}: schema differs from the other files ({e})") from None


class TrainStream:
    """Infinite shuffled batches. Epoch e is a permutation drawn from (data_seed, e); the batch
    for step s is a pure function of s, so the data position in a checkpoint is the step."""

    def __init__(self, workload: Workload, ranges: list[RowRange], batch_size: int, data_seed: int):
        self.tensors = workload.to_batch(read_ranges(ranges, workload.columns))
        self.num_examples = len(self.tensors["label"])
        self.batch_size = batch_size
        self.data_seed = data_seed
        self._epoch, self._perm = -1, None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.data_seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.num_examples, generator=g)
        return self._perm

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        start = step * self.batch_size
        epoch, offset = divmod(start, self.num_examples)
        if offset + self.batch_size <= self.num_examples:  # within one epoch: a slice (the usual case)
            index = self._permutation(epoch)[offset : offset + self.batch_size]
            return {k: v[index] for k, v in self.tensors.items()}
        positions = torch.arange(start, start + self.batch_size)
        epochs, within = positions // self.num_examples, positions % self.num_examples
        index = torch.empty_like(positions)
        for epoch in torch.unique(epochs).tolist():  # a batch spans at most a few epochs
            mask = epochs == epoch
            index[mask] = self._permutation(epoch)[within[mask]]
        return {k: v[index] for k, v in self.tensors.items()}


def eval_batches(
    workload: Workload, ranges: list[RowRange], batch_size: int, keep: torch.Tensor | None = None
) -> Iterator[dict]:
    """This rank's eval examples in file order, `batch_size` at a time (the last may be short);
    with `keep`, only those positions of the shard (a fixed eval sample)."""
    if not ranges:
        return
    tensors = workload.to_batch(read_ranges(ranges, workload.columns))
    if keep is not None:
        tensors = {k: v[keep] for k, v in tensors.items()}
    n = len(tensors["label"])
    for start in range(0, n, batch_size):
        yield {k: v[start : start + batch_size] for k, v in tensors.items()}
