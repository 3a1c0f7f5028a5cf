"""Replicated input workers through Ray Data (the playbook's "replicate input workers", the
tf.data service analogue), for CPU-heavy online preprocessing: `input.workers: ray_data`.

Ray edge: the trainer core never imports this module; `launch.train_worker` injects it into
the loop as its `BatchSource`. The rank still plans its own windows (`TrainStream.plan`: its
own shard of its own host's files, the same per-host seeds), so sharding is exactly that of
the local loader; only the work of a window -- reading its row groups and the workload's
`to_batch` -- runs on a pool of `input.num_input_workers` Ray Data actors. Ray Data keeps the
order (`preserve_order`), so the rows, and so every batch, are the local loader's bit for bit,
and a resumed trial continues the same sequence. Reading and preprocessing time is spent in
the actors: the rank's `input/read_s` and `input/preprocess_s` stay near zero, its
`input/wait_s` is what remains exposed.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import ray.data
import torch

from service.data.loader import Batch, TrainStream, WindowReader, WindowTask, rebatch

WINDOWS_PER_DATASET = 32
"""The window plan is infinite; it is served by one Ray Data dataset per this many windows."""


class _WindowLoader:
    """A Ray Data actor: loads one window per call with its own reader."""

    def __init__(self, stream: TrainStream):
        self.stream, self.reader = stream, WindowReader(stream.workload)

    def __call__(self, batch: dict) -> dict[str, np.ndarray]:
        (task,) = batch["task"]
        return {k: v.numpy() for k, v in self.stream.load(task, self.reader).items()}


def ray_data_source(
    num_workers: int,
    cpus_per_worker: float = 1.0,
    prefetch_batches: int = 2,
    windows_per_dataset: int = WINDOWS_PER_DATASET,
):
    """A `loop.BatchSource` whose windows are loaded by `num_workers` Ray Data actors."""

    def source(stream: TrainStream, start_step: int) -> Iterator[Batch]:
        plan = stream.plan(start_step * stream.batch_size)
        chunks = _chunks(stream, plan, num_workers, cpus_per_worker, prefetch_batches, windows_per_dataset)
        return rebatch(chunks, stream.batch_size, keep_last=False)

    return source


def _chunks(
    stream: TrainStream,
    plan: Iterator[WindowTask],
    num_workers: int,
    cpus_per_worker: float,
    prefetch_batches: int,
    windows_per_dataset: int,
) -> Iterator[Batch]:
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    while True:
        tasks = list(itertools.islice(plan, windows_per_dataset))
        ds = ray.data.from_items([{"task": t} for t in tasks]).map_batches(
            _WindowLoader,
            fn_constructor_args=(stream,),
            batch_size=1,
            concurrency=num_workers,
            num_cpus=cpus_per_worker,
        )
        for block in ds.iter_batches(
            batch_size=None, batch_format="numpy", prefetch_batches=prefetch_batches
        ):
            yield {k: torch.from_numpy(np.array(v)) for k, v in block.items()}  # a writable copy
