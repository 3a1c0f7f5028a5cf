"""The step loop: train exactly max_train_steps, evaluate every eval_every_steps (and at the
end), report each evaluation with a checkpoint, resume from the latest checkpoint.

Plain PyTorch (torch.distributed when initialised); Ray is reached only through `Reporter`.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from service.core.ranking import best_row, worst
from service.core.trial_status import TrialStatus
from service.data import files
from service.data.loader import Batch, TrainStream
from service.data.prefetch import prefetch_stream
from service.distributed import checkpoint, fence, sharded, sharding, topology_record
from service.distributed.checkpoint import TrialState
from service.distributed.rank0 import Rank0
from service.distributed.topology import Topology, init_seed
from service.nn.batchnorm import sync_batchnorm_stats
from service.planning.trial import TrialPlan
from service.trainer import rng
from service.trainer.evals import run_evals, train_eval_fields
from service.trainer.optimizers import build_optimizer  # noqa: F401  (imported from here by tests)
from service.trainer.profiling import StepProfiler
from service.trainer.setup import Progress, TrialContext, set_up
from service.trainer.step import train_step
from service.trainer.tally import all_reduce_min, all_reduce_sum


class Reporter(Protocol):
    def report(self, metrics: dict, checkpoint_dir: str | None) -> None:
        """Called by every rank after each evaluation (a barrier); only rank 0 passes a dir."""

    def restore(self) -> TrialState | None:
        """The latest checkpoint's state, or None on a fresh start."""


BatchSource = Callable[[TrainStream, int], Iterator[Batch]]
"""(this rank's stream, first step) -> the batches of that step on. The default prefetches on a
background thread; `service.orchestration.ray_input` serves them from Ray Data input workers."""


def local_batches(depth: int, pin: bool = False) -> BatchSource:
    return lambda stream, start_step: prefetch_stream(stream, start_step, depth, pin)


class Checkpointer(Protocol):
    """Where the checkpoints go when the caller keeps them itself (no Ray Train): see
    `distributed.checkpoint_store` and, for a sharded model, `distributed.sharded`. Without
    one, each checkpoint is written to a temporary directory and handed to `Reporter.report`
    (Ray Train persists and retains it)."""

    every_rank: bool
    """Every rank saves (its shards) and closes; otherwise rank 0 alone."""

    def save(self, state: TrialState, metrics: dict) -> str:
        """Save (or start saving) `state`; returns its URI."""

    def close(self) -> None:
        """Wait for saves still in flight; raise the error of a failed one."""


def train(
    plan: TrialPlan,
    topo: Topology,
    reporter: Reporter,
    device=None,
    batch_source: BatchSource | None = None,
    checkpointer: Checkpointer | None = None,
) -> dict:
    """Run (or resume) one trial on this rank. Returns the trial summary."""
    try:
        return _train(plan, topo, reporter, device, batch_source, checkpointer)
    finally:
        if checkpointer is not None:
            on_its_ranks(checkpointer, Rank0(topo), checkpointer.close)


def _train(plan: TrialPlan, topo: Topology, reporter: Reporter, device, batch_source, checkpointer) -> dict:
    """The playbook's order of operations: set up (1. model and optimizer, 2. data and eval
    plan), 3. restore the latest checkpoint, then 4. train step by step, stopping at 5. each
    eval point to evaluate, checkpoint and report."""
    ctx = set_up(plan, topo, device or torch.device("cpu"))
    assert checkpointer is not None or not sharding.is_sharded(ctx.model), "shards need a Checkpointer"
    progress = restore(ctx, reporter)
    record_topology(ctx, progress.step)
    pin = torch.device(ctx.device).type == "cuda"  # pinned host batches: non_blocking copies really are
    source = batch_source or local_batches(plan.study.input.prefetch_batches, pin)
    batches = source(ctx.stream, progress.step)
    profiler = StepProfiler(
        plan.layout.profile_trace,
        plan.study.input.profile_steps,
        first_step=progress.step + 1,
        cuda=pin,
    )
    while progress.step < ctx.max_steps:
        train_step(ctx, progress, batches, profiler)
        if progress.step % plan.study.training.eval_every_steps and progress.step != ctx.max_steps:
            continue
        if not eval_point(ctx, progress, reporter, checkpointer):
            break  # diverged
    ctx.rank0.run(profiler.close)  # a trial that ended inside its profiled steps
    return summary(ctx, progress)


# 3. Restore the latest checkpoint.


def restore(ctx: TrialContext, reporter: Reporter) -> Progress:
    """Weights, optimizer, step (the schedule's and the data's position), RNG and history from
    the latest checkpoint; a fresh start without one."""
    topo = ctx.topo
    state = reporter.restore() or TrialState()
    if state.model or state.shards:
        if state.shards:  # this rank's part of a sharded checkpoint, whoever wrote it
            sharded.load_shards(state, ctx.model, ctx.optimizer)
        else:
            sharding.load_state_dicts(ctx.model, ctx.optimizer, state.model, state.optimizer)
        ctx.precision.load_state_dict(state.scaler)
        if len(state.rng_states) == topo.world_size:
            rng.restore(state.rng_states[topo.world_rank])
        else:  # the ranks' draws cannot continue as before: the run is no longer bitwise
            ctx.rank0.run(
                print,
                f"[{ctx.plan.trial_name}] warning: resumed on {topo.world_size} ranks from a checkpoint "
                f"of {len(state.rng_states)}; random draws restart from the data seeds",
                flush=True,
            )
    return Progress(state.step, list(state.history))


def record_topology(ctx: TrialContext, step: int) -> None:
    """Every rank's seeds, initial weights, files and first batch, in `<trial>/topology.json`."""
    plan = ctx.plan
    records = topology_record.gather(
        topology_record.rank_record(
            ctx.topo,
            init_seed(plan.trial_seed),
            ctx.data_seed,
            ctx.init_params,
            sorted(set(files.OPENED[ctx.opened_before :])),
            ctx.stream.batch(0)["example_id"],
            resumed_from_step=step,
        )
    )
    ctx.rank0.run(
        topology_record.write, plan.topology_uri, plan.trial_name, plan.study.scaling.num_hosts, records
    )


# 5. One eval point: BN stats sync, evaluations, checkpoint, report.


def eval_point(
    ctx: TrialContext, progress: Progress, reporter: Reporter, checkpointer: Checkpointer | None
) -> bool:
    """Read the interval's loss tally (the one host sync of the interval), agree on divergence,
    sync BN stats, evaluate, checkpoint, report. False when the trial diverged (it stops)."""
    row, first_bad_step = interval_row(ctx, progress)
    if first_bad_step is not None:
        report_divergence(ctx, progress, row, first_bad_step, reporter)
        return False
    sync_start = time.perf_counter()
    sync_batchnorm_stats(ctx.model)
    row["multihost/bn_sync_s"] = time.perf_counter() - sync_start
    eval_start = time.perf_counter()
    row.update(run_evals(ctx, progress.step))
    row["eval_s"] = time.perf_counter() - eval_start
    if ctx.evals.train_part is not None:
        row.update(train_eval_fields(ctx))
    progress.history.append(row)
    checkpoint_and_report(ctx, progress, row, reporter, checkpointer)
    progress.steps_in_interval = 0
    progress.interval_start = time.perf_counter()
    return True


def interval_row(ctx: TrialContext, progress: Progress) -> tuple[dict, float | None]:
    """The interval's row of training metrics, summed over ranks, and the first non-finite step
    of this rank when any rank saw one (None when none did)."""
    loss_sum, loss_count, norm_sum, clipped, norm_count, first_bad_step = ctx.tally.take()
    elapsed_s = time.perf_counter() - progress.interval_start
    bad_flag = 0.0 if math.isinf(first_bad_step) else 1.0
    reduce_start = time.perf_counter()
    loss_total, loss_n, bad, norm_total, clipped_n, norm_n, *input_s = all_reduce_sum(
        [
            loss_sum,
            loss_count,
            bad_flag,
            norm_sum,
            clipped,
            norm_count,
            *ctx.timer.take(),
            *ctx.stream.stats.take(),
        ],
        ctx.device,
    )
    reduce_s = time.perf_counter() - reduce_start
    row = {
        "step": progress.step,
        "learning_rate": progress.lr,
        "train/loss": loss_total / loss_n if loss_n else math.nan,
        "steps_per_s": progress.steps_in_interval / max(elapsed_s, 1e-9),
        **clip_fields(ctx, norm_total, clipped_n, norm_n, progress.steps_in_interval),
        **input_fields(input_s, ctx.unused_columns),
        "multihost/reduce_s": reduce_s,  # this rank's wait in the metric all-reduce
    }
    return row, first_bad_step if bad else None


def clip_fields(ctx: TrialContext, norm_total: float, clipped: float, norms: float, steps: int) -> dict:
    """The interval's mean finite gradient norm before clipping and the fraction of its steps
    that were clipped (0 without grad_clip_norm; sums over ranks, whose norms are equal, over
    ranks x steps; an fp16 step whose gradients overflowed has no finite norm and is not clipped)."""
    if not steps:
        return {}
    n = steps * ctx.topo.world_size
    return {
        "train/grad_norm": norm_total / norms if norms else math.nan,
        "train/clipped_fraction": clipped / n,
    }


def report_divergence(
    ctx: TrialContext, progress: Progress, row: dict, first_bad_step: float, reporter: Reporter
) -> None:
    """Every rank agrees (a reduced value), so every rank ends the trial here: the earliest bad
    step over ranks, the worst metric, no checkpoint."""
    tr = ctx.training
    diverged_at = int(all_reduce_min(first_bad_step, ctx.device))
    row.update(
        {"status": TrialStatus.DIVERGED.reported, "diverged_at_step": diverged_at, tr.metric: worst(tr.mode)}
    )
    ctx.rank0.run(
        print, f"[{ctx.plan.trial_name}] diverged: non-finite loss at step {diverged_at}", flush=True
    )
    progress.history.append(row)
    ctx.rank0.run(ctx.metrics_log.write, progress.history)
    reporter.report(row, None)


def checkpoint_and_report(
    ctx: TrialContext, progress: Progress, row: dict, reporter: Reporter, checkpointer: Checkpointer | None
) -> None:
    """Rank 0 saves the checkpoint (through `checkpointer`, or to a temporary directory handed to
    the reporter), then the metrics log; every rank reports. `checkpoint_s` is how long the eval
    point waited for its checkpoint: a background save until it was handed over, a Ray Train
    trial's local copy but not its upload by `ray.train.report`."""
    tr, step, history = ctx.training, progress.step, progress.history
    best = best_row(history, tr.metric, tr.mode)
    report = {  # flat scalars only: per-class details stay in the metrics log
        **{k: v for k, v in row.items() if not k.endswith("/per_class")},
        "status": (TrialStatus.RUNNING if step < ctx.max_steps else TrialStatus.FINISHED).reported,
        "best_step": best["step"],
        "best_metric": best[tr.metric],
    }
    attempt = fence.held(ctx.plan.trial_uri)
    if attempt is not None:  # which attempt at the trial reports (the study's restart counts)
        report["attempt"] = attempt.attempt
    rng_states = topology_record.gather(rng.capture())  # every rank's generators, by world rank
    model_state, optimizer_state = sharding.state_dicts(ctx.model, ctx.optimizer)  # a shard's, under fsdp
    state = TrialState(
        step,
        model_state,
        optimizer_state,
        rng_states,
        history,
        dict(ctx.plan.hparams),
        ctx.precision.state_dict(),
    )
    save_start = time.perf_counter()
    if checkpointer is not None:
        on_its_ranks(checkpointer, ctx.rank0, checkpointer.save, state, report)
        row["checkpoint_s"] = time.perf_counter() - save_start
        ctx.rank0.run(ctx.metrics_log.write, history)
        reporter.report({**report, "checkpoint_s": row["checkpoint_s"]}, None)
    else:
        with tempfile.TemporaryDirectory(prefix="playbook-ckpt-") as tmp:
            saved = ctx.rank0.run(save_checkpoint, state, tmp, report)
            row["checkpoint_s"] = time.perf_counter() - save_start
            ctx.rank0.run(ctx.metrics_log.write, history)
            reporter.report({**report, "checkpoint_s": row["checkpoint_s"]}, saved)


def on_its_ranks(checkpointer: Checkpointer, rank0: Rank0, fn: Callable, *args):
    """Call a checkpointer's method where it runs: every rank for sharded checkpoints, else rank 0."""
    return fn(*args) if checkpointer.every_rank else rank0.run(fn, *args)


def summary(ctx: TrialContext, progress: Progress) -> dict:
    """What `train` returns: the trial's last step, its history, its status and its best row."""
    tr, history = ctx.training, progress.history
    best = best_row(history, tr.metric, tr.mode)
    finished = TrialStatus.FINISHED.reported
    return {
        "trial_name": ctx.plan.trial_name,
        "last_step": progress.step,
        "history": history,
        "status": history[-1].get("status", finished) if history else finished,
        "best_step": best["step"] if best else None,
        "best_metric": best[tr.metric] if best else None,
    }


TIMING_FIELDS = (
    "steps_per_s",
    "input/exposed_fraction",
    "input/wait_s",
    "input/step_s",
    "input/read_s",
    "input/preprocess_s",
    "input/augment_s",
    "multihost/reduce_s",
    "multihost/bn_sync_s",
    "eval_s",
    "checkpoint_s",
)
"""Metrics-log fields that are wall-clock measurements: they differ between identical runs (the
`multihost/*` ones also between the ranks of one run: each rank times its own collective)."""


def input_fields(sums: list[float], unused: str) -> dict:
    """The interval's input timings, summed over ranks (see `service.analysis.input_bound`)."""
    wait_s, step_s, read_s, preprocess_s, augment_s = sums
    return {
        "input/exposed_fraction": wait_s / step_s if step_s > 0 else 0.0,
        "input/wait_s": wait_s,
        "input/step_s": step_s,
        "input/read_s": read_s,
        "input/preprocess_s": preprocess_s,
        "input/augment_s": augment_s,
        "input/unused_columns": unused,
    }


def save_checkpoint(state: TrialState, directory: str, metrics: dict) -> str:
    checkpoint.save(state, directory, metrics)
    return directory
