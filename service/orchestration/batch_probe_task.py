"""`playbook find-batch-size` on the Ray cluster: each per-worker batch size is measured by a
Ray task that holds what one of the study's trial workers holds (`scaling.cpus_per_worker`
CPUs, a GPU with `use_gpu`) and trains as the trial's worker does (`trainer.batch_probe`,
with the study's input: its own prefetch thread, input processes or Ray Data workers).
Sizes are probed in order until one does not fit or does not speed training
(`analysis.batch_size`); the table and the reading go to stdout and to the study's storage."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

import ray
import torch

from service.analysis import batch_size
from service.core import storage
from service.orchestration.launch import batch_source
from service.study.spec import Study
from service.trainer import batch_probe
from service.trainer.batch_probe import SizeResult


def probe_sizes(
    measure_one: Callable[[int], SizeResult], sizes: list[int], min_gain: float = batch_size.MIN_GAIN
) -> list[SizeResult]:
    """Measure `sizes` in order, stopping after the first that does not fit or does not pay."""
    rows = []
    for size in sizes:
        rows.append(measure_one(size))
        print(f"per-worker batch size {size}: {progress_cell(rows[-1])}", file=sys.stderr, flush=True)
        if not batch_size.keeps_scaling(rows, min_gain):
            break
    return rows


def progress_cell(row: SizeResult) -> str:
    return f"{row.examples_per_s:,.0f} examples/s" if row.fits else f"does not fit ({row.error})"


@ray.remote(max_retries=0)
def probe_task(study: Study, size: int, steps: int) -> SizeResult:
    """One size on a worker like the trial's (its CPU threads, its device, its input)."""
    torch.set_num_threads(max(1, int(study.scaling.cpus_per_worker)))
    device = torch.device("cuda") if study.scaling.use_gpu else torch.device("cpu")
    return batch_probe.measure(study, size, device, steps, batch_source=batch_source(study))


def measure_on_cluster(study: Study, size: int, steps: int) -> SizeResult:
    """`probe_task` with one trial worker's resources. A task whose process Ray's memory
    monitor ended (the node's host memory ran out) did not fit either."""
    s = study.scaling
    task = probe_task.options(num_cpus=s.cpus_per_worker, num_gpus=1 if s.use_gpu else 0)
    try:
        return ray.get(task.remote(study, size, steps))
    except ray.exceptions.OutOfMemoryError as e:
        return SizeResult(size, False, error=batch_probe.first_line(e))


def find_batch_size(
    study: Study, sizes: list[int], steps: int, out: str | None, min_gain: float = batch_size.MIN_GAIN
) -> batch_size.Reading:
    """Probe, read, print the table and the reading, and write them (`out`: the JSON's URI,
    default `<study>/batch_size.json`; the text table beside it, `.txt`)."""
    rows = probe_sizes(lambda size: measure_on_cluster(study, size, steps), sizes, min_gain)
    reading = batch_size.read(rows, study, min_gain)
    lines = batch_size.table_lines(rows, study, reading)
    json_uri = storage.absolute(out) if out else study.layout.batch_size
    table_uri = study.layout.batch_size_table if not out else json_uri.removesuffix(".json") + ".txt"
    storage.write_json(json_uri, record(study, rows, reading, steps, min_gain))
    text = "\n".join([*lines, "", reading.message, ""])
    storage.write_bytes_atomic(table_uri, text.encode())
    print(text, end="")
    print(f"table: {table_uri} (json: {json_uri})")
    return reading


def record(
    study: Study, rows: list[SizeResult], reading: batch_size.Reading, steps: int, min_gain: float
) -> dict:
    """What batch_size.json holds: the probe's conditions, every row, and the reading."""
    s = study.scaling
    return {
        "study": study.name,
        "device": rows[0].device,
        "steps": steps,
        "warmup_steps": batch_probe.WARMUP_STEPS,
        "min_gain": min_gain,
        "num_hosts": s.num_hosts,
        "workers_per_host": s.workers_per_host,
        "study_batch_size": study.training.batch_size,
        "rows": [dataclasses.asdict(r) for r in rows],
        "per_worker_batch": reading.per_worker_batch,
        "global_batch": reading.global_batch,
        "stopped": reading.stopped,
        "message": reading.message,
    }
