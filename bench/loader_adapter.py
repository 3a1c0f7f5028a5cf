"""The one place the loader benchmarks reach the service's training input: the streaming,
prefetching loader (`service.data.loader.iterate_files`) over a directory of digits-like files,
served by the prefetch thread or by input worker processes (`input.workers: processes`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import numpy as np
import pyarrow as pa
import torch

from service.data.loader import iterate_files
from service.data.process_input import process_source
from service.workloads.digits import Digits

Batch = dict[str, torch.Tensor]


def heavy_preprocess(batch: Batch) -> Batch:
    """CPU-heavy per-example preprocessing (a stand-in for decoding/augmenting): a few numpy
    operations per example, in a Python loop."""
    x = batch["features"].numpy()
    out = np.empty_like(x)
    for k in range(len(x)):
        img = x[k, 0]
        img = np.roll(img, k % 3, axis=1)
        out[k, 0] = np.clip(img * 1.1 - 0.05 + np.tanh(img) * 0.1, 0.0, 1.0)
    return {**batch, "features": torch.from_numpy(out)}


class Preprocessed(Digits):
    """Digits whose `to_batch` is followed by `online`, where a workload's online preprocessing
    runs. At module level, so that input worker processes can unpickle it (with a module-level
    `online`)."""

    def __init__(self, online: Callable[[Batch], Batch]):
        self.online = online

    def to_batch(self, table: pa.Table) -> Batch:
        return self.online(super().to_batch(table))


def service_batches(
    train_uri: str,
    batch_size: int,
    num_batches: int,
    seed: int = 0,
    preprocess: Callable[[Batch], Batch] | None = None,
    prefetch_batches: int = 2,
    num_workers: int = 0,
) -> Iterator[Batch]:
    """`num_batches` training batches of one rank (one host, one worker) as the trainer gets
    them, opening the files included. `preprocess` runs where a workload's online
    preprocessing runs: inside `to_batch`, on the loader's prefetch thread when there is one,
    or in `num_workers` input worker processes when that is > 0. The loader is closed after
    the last batch."""
    workload = Digits() if preprocess is None else Preprocessed(preprocess)
    source = process_source(num_workers) if num_workers else None
    batches = iterate_files(
        workload, [train_uri], batch_size, seed, prefetch_batches=prefetch_batches, source=source
    )
    try:
        yield from itertools.islice(batches, num_batches)
    finally:  # the prefetch thread and the reads ahead stop with the last batch
        close = getattr(batches, "close", None)
        if close is not None:
            close()
