"""The one place the loader benchmarks reach the service's training input. Re-point
`service_batches` when the loader changes (issue #5's streaming, prefetching loader); the
benchmarks and their results.json keys stay the same."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from service import workloads
from service.data.files import list_files
from service.data.loader import TrainStream
from service.data.sharding import train_shard

Batch = dict[str, torch.Tensor]


def service_batches(
    train_uri: str,
    batch_size: int,
    num_batches: int,
    seed: int = 0,
    preprocess: Callable[[Batch], Batch] | None = None,
) -> Iterator[Batch]:
    """`num_batches` training batches of one rank (one host, one worker) as the trainer gets
    them, opening the files included; `preprocess` applied to each batch. The current loader
    reads the whole shard up front and has no prefetch, so preprocessing runs in line."""
    workload = workloads.get("digits")
    ranges = train_shard(list_files(train_uri), 1, 0, 1, 0)
    stream = TrainStream(workload, ranges, batch_size, seed)
    for step in range(num_batches):
        batch = stream.batch(step)
        yield preprocess(batch) if preprocess else batch
