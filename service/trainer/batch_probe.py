"""One per-worker batch size measured as a trial would train it (`playbook find-batch-size`).

The probe builds the study's model, optimizer, precision and compile setting through the same
`setup.set_up` a trial uses, reads the study's real training data through the same prefetching
stream (reading is part of what a trial pays for a step), runs a few warmup steps (compilation,
allocator and cache warm-up), then times blocks of steps of `step.train_step`. It trains one
worker alone: no all-reduce, no other rank to wait for.

What the probe changes in the study, and why:
- `training.batch_size` is the probed size on a single worker (per-worker batch);
- `training.microbatch_size` is dropped: accumulating gradients over microbatches cuts memory,
  not time per example, and the question here is which whole batch fits and pays;
- the learning-rate schedule is constant (a schedule's warmup does not change a step's speed);
- searched hyperparameters sit at the middle of their range (`find_steps.middle`), since a
  model hyperparameter (a width) changes the step.

A size that does not fit (torch's out-of-memory error on CUDA, the allocator's failure on CPU)
is a result, not an error: the probe frees what it held and reports it as not fitting."""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from dataclasses import dataclass

import torch

from service.distributed.topology import Topology
from service.planning.find_steps import middle
from service.planning.trial import TrialPlan
from service.study.spec import Study
from service.study.training import Scaling, Schedule
from service.trainer.loop import BatchSource, local_batches
from service.trainer.profiling import StepProfiler
from service.trainer.setup import Progress, TrialContext, set_up
from service.trainer.step import train_step

WARMUP_STEPS = 3
"""Steps run before the timed ones (not timed)."""
MIN_BLOCKS = 3
MAX_BLOCKS = 50
MIN_TIMED_S = 1.0
"""A size's timed steps run in blocks of `steps`: at least MIN_BLOCKS of them and until
MIN_TIMED_S seconds are timed (a fast step's few milliseconds are mostly noise), at most
MAX_BLOCKS. The median block gives the examples/s."""
PROBE_TRIAL = "batch-probe"
OUT_OF_MEMORY_TEXTS = ("out of memory", "can't allocate memory", "cannot allocate memory")
"""How an allocation failure reads in a RuntimeError's message (CUDA's older one, torch's CPU
allocator, the operating system's ENOMEM)."""


@dataclass(frozen=True)
class SizeResult:
    """One probed per-worker batch size."""

    per_worker_batch: int
    fits: bool
    examples_per_s: float | None = None  # one worker's, in the median timed block
    step_s: float | None = None  # wall-clock seconds per step in the median timed block
    peak_memory_bytes: int | None = None  # CUDA: torch.cuda.max_memory_allocated; None on CPU
    input_wait_fraction: float | None = None  # of the timed steps' time, spent waiting for a batch
    error: str | None = None  # why it does not fit (the allocator's message, first line)
    device: str = ""  # where it was measured: the GPU's name, or the CPU and its threads


def probe_study(study: Study, per_worker_batch: int) -> Study:
    """The study as the probe trains it: one worker with the whole per-worker batch."""
    training = dataclasses.replace(
        study.training,
        batch_size=per_worker_batch,
        eval_batch_size=None,
        eval_batch_size_reason=None,
        microbatch_size=None,
    )
    return dataclasses.replace(study, training=training, scaling=single_worker(study.scaling))


def probe_hparams(study: Study) -> dict:
    """Fixed hyperparameters at their value, searched ones at their middle."""
    return {name: middle(hp) if hp.searched else hp.value for name, hp in study.search.items()}


def probe_plan(study: Study, per_worker_batch: int, steps: int) -> TrialPlan:
    return TrialPlan(
        study=probe_study(study, per_worker_batch),
        trial_name=PROBE_TRIAL,
        round_name=PROBE_TRIAL,
        hparams=probe_hparams(study),
        max_train_steps=steps,
        schedule=Schedule(kind="constant"),
    )


def measure(
    study: Study,
    per_worker_batch: int,
    device,
    steps: int,
    warmup: int = WARMUP_STEPS,
    batch_source: BatchSource | None = None,
    min_seconds: float = MIN_TIMED_S,
) -> SizeResult:
    """Train one worker at `per_worker_batch`: `warmup` steps, then blocks of `steps` timed
    steps (at least `MIN_BLOCKS`, and until `min_seconds` are timed); examples/s from the
    median block. A size whose memory runs out is returned as not fitting. `batch_source`: the
    trial's input (`loop.train`'s; default: the loop's own prefetch thread)."""
    device = torch.device(device)
    reset_peak_memory(device)
    where = device_name(device)
    plan = probe_plan(study, per_worker_batch, warmup + steps * MAX_BLOCKS)
    try:
        blocks, wait_s = timed_blocks(plan, device, steps, warmup, batch_source, min_seconds)
    except (RuntimeError, MemoryError) as e:
        if not is_out_of_memory(e):
            raise
        error = first_line(e)
    else:
        block_s = statistics.median(blocks)
        return SizeResult(
            per_worker_batch,
            True,
            examples_per_s=per_worker_batch * steps / block_s,
            step_s=block_s / steps,
            peak_memory_bytes=peak_memory(device),
            input_wait_fraction=min(1.0, wait_s / sum(blocks)),
            device=where,
        )
    free_memory(device)  # outside the handler: the traceback's frames (and tensors) are gone
    return SizeResult(per_worker_batch, False, error=error, device=where)


def timed_blocks(
    plan: TrialPlan,
    device: torch.device,
    steps: int,
    warmup: int,
    batch_source: BatchSource | None,
    min_seconds: float,
) -> tuple[list[float], float]:
    """(wall-clock seconds of each block of `steps` timed steps, seconds of all of them spent
    waiting for input)."""
    ctx = set_up(plan, Topology(), device)
    source = batch_source or local_batches(plan.study.input.prefetch_batches, device.type == "cuda")
    batches = source(ctx.stream, 0)
    try:
        progress = Progress(0, [])
        run_steps(ctx, progress, batches, warmup)
        synchronize(device)
        ctx.timer.take()
        blocks: list[float] = []
        while len(blocks) < MAX_BLOCKS and (len(blocks) < MIN_BLOCKS or sum(blocks) < min_seconds):
            start = time.perf_counter()
            run_steps(ctx, progress, batches, steps)
            synchronize(device)
            blocks.append(time.perf_counter() - start)
        return blocks, ctx.timer.take()[0]
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()


def run_steps(ctx: TrialContext, progress: Progress, batches, n: int) -> None:
    profiler = StepProfiler(ctx.plan.layout.profile_trace, 0, first_step=0)  # profiles nothing
    for _ in range(n):
        train_step(ctx, progress, batches, profiler)


def is_out_of_memory(e: BaseException) -> bool:
    """An allocation failure: torch's OutOfMemoryError, MemoryError, a RuntimeError saying so
    (CPU allocator), or any error caused by one (torch.compile wraps what fails inside it)."""
    while e is not None:
        if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
            return True
        if isinstance(e, RuntimeError) and any(t in str(e).lower() for t in OUT_OF_MEMORY_TEXTS):
            return True
        e = e.__cause__
    return False


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return f"cpu: {torch.get_num_threads()} thread(s)"


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs a step asynchronously to the host)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int | None:
    """The most device memory tensors held during the size's steps (CUDA); CPU: not measured."""
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def free_memory(device: torch.device) -> None:
    """Give back what a failed size held: collect its objects, return CUDA's cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def single_worker(scaling: Scaling) -> Scaling:
    """The resources of one of the study's workers (what the probe reserves on a cluster); its
    model whole (under fsdp too: one worker has nothing to shard over)."""
    return dataclasses.replace(
        scaling, num_hosts=1, workers_per_host=1, strategy="ddp", shard_group_size=None
    )
