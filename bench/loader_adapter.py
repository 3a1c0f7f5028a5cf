"""The one place the loader benchmarks reach the service's training input: the streaming,
prefetching loader (`service.data.loader.iterate_files`) over a directory of digits-like files."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import pyarrow as pa
import torch

from service import workloads
from service.data.loader import iterate_files

Batch = dict[str, torch.Tensor]


def service_batches(
    train_uri: str,
    batch_size: int,
    num_batches: int,
    seed: int = 0,
    preprocess: Callable[[Batch], Batch] | None = None,
    prefetch_batches: int = 2,
) -> Iterator[Batch]:
    """`num_batches` training batches of one rank (one host, one worker) as the trainer gets
    them, opening the files included. `preprocess` runs where a workload's online
    preprocessing runs: inside `to_batch`, on the loader's prefetch thread when there is one."""
    workload = workloads.get("digits")
    if preprocess is not None:
        base = workload

        class Preprocessed(type(base)):
            def to_batch(self, table: pa.Table) -> Batch:
                return preprocess(base.to_batch(table))

        workload = Preprocessed()
    batches = iterate_files(workload, [train_uri], batch_size, seed, prefetch_batches=prefetch_batches)
    return itertools.islice(batches, num_batches)
