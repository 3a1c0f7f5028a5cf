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
import torch.distributed as dist
from torch import nn

from service import workloads
from service.core.ranking import best_row, worst
from service.data import files
from service.data.files import list_files
from service.data.input_timer import InputTimer
from service.data.loader import Batch, TrainStream, eval_batches, unused_columns
from service.data.prefetch import prefetch_stream
from service.data.sharding import row_ranges, train_shard
from service.evaluation import predictions as prediction_files
from service.evaluation.predictions import PredictionLog
from service.evaluation.run import evaluate
from service.evaluation.sampling import bias_fields, is_full_eval, plan_sample, sample_of
from service.nn.batchnorm import sync_batchnorm_stats
from service.nn.ghost_batchnorm import convert_to_ghost, ghost_group
from service.planning.trial import TrialPlan
from service.trainer import checkpoint, rng, topology_record
from service.trainer.checkpoint import TrialState
from service.trainer.metrics_log import MetricsLog
from service.trainer.profiling import StepProfiler
from service.trainer.rank0 import Rank0
from service.trainer.topology import Topology, data_seed, init_seed


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
    """Where rank 0's checkpoints go when the caller keeps them itself (no Ray Train): see
    `trainer.checkpoint_store`. Without one, each checkpoint is written to a temporary
    directory and handed to `Reporter.report` (Ray Train persists and retains it)."""

    def save(self, state: TrialState, metrics: dict) -> str:
        """Save (or start saving) `state`; returns its URI."""

    def close(self) -> None:
        """Wait for saves still in flight; raise the error of a failed one."""


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def build_optimizer(name: str, params, hparams: dict) -> torch.optim.Optimizer:
    lr = float(hparams["learning_rate"])
    wd = float(hparams.get("weight_decay", 0.0))
    if name == "adamw":
        betas = (float(hparams.get("beta1", 0.9)), float(hparams.get("beta2", 0.999)))
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=wd)
    momentum = float(hparams.get("momentum", 0.9))
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=wd, nesterov=name == "nesterov")


class StepTally:
    """An interval's training-loss sum and count (finite losses) and its first non-finite step,
    kept as device tensors: adding a step's loss reads nothing back to the host, so the step
    never waits for the device (the playbook: no accidental host syncs in the input pipeline's
    way). `take()` reads them at an eval point, in one transfer, and starts the next interval."""

    def __init__(self, device):
        self.device = device
        self._start()

    def _start(self) -> None:
        self.sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, count
        self.first_bad = torch.full((), math.inf, dtype=torch.float64, device=self.device)

    def add(self, loss: torch.Tensor, step: int) -> None:
        value = loss.detach().double()
        finite = torch.isfinite(value)
        self.sums += torch.stack([torch.where(finite, value, 0.0), finite.double()])
        this_step = torch.full((), float(step), dtype=torch.float64, device=self.device)
        self.first_bad = torch.where(finite, self.first_bad, torch.minimum(self.first_bad, this_step))

    def take(self) -> tuple[float, float, float]:
        """(loss sum, finite steps, first non-finite step or inf) since the last take."""
        loss_sum, count, first_bad = torch.cat([self.sums, self.first_bad.view(1)]).tolist()
        self._start()
        return loss_sum, count, first_bad


def step_sync_debug(inp, device) -> str | None:
    """`input.sync_debug` on a CUDA device: torch's sync debug mode during each training step
    ("warn": one warning naming the Python line of each device-to-host sync). Off elsewhere."""
    return "warn" if inp.sync_debug and torch.device(device).type == "cuda" else None


def all_reduce_sum(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if distributed():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_reduce_min(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    if distributed():
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return float(t.item())


def gather_rng_states() -> list[dict]:
    """Every rank's generator states (`trainer.rng`), indexed by world rank."""
    mine = rng.capture()
    if not distributed():
        return [mine]
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, mine)
    return states


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
            Rank0(topo).run(checkpointer.close)


def _train(plan: TrialPlan, topo: Topology, reporter: Reporter, device, batch_source, checkpointer) -> dict:
    device = device or torch.device("cpu")
    study, tr = plan.study, plan.study.training
    workload = workloads.get(study.workload)
    rank0 = Rank0(topo)
    max_steps = plan.max_train_steps or tr.max_train_steps

    # 1. Model: the same init seed on every rank -> bit-identical initial weights.
    torch.manual_seed(init_seed(plan.trial_seed))
    model = workload.build_model(plan.hparams).to(device)
    if tr.ghost_batch_norm:  # BN statistics over virtual batches, not the per-worker batch
        group = ghost_group(tr.batch_size // topo.world_size, tr.virtual_batch_size)
        convert_to_ghost(model, tr.virtual_batch_size, group)
    init_params = topology_record.params_sha256(model)
    ddp = nn.parallel.DistributedDataParallel(model, broadcast_buffers=False) if distributed() else model
    optimizer = build_optimizer(tr.optimizer, model.parameters(), plan.hparams)
    # Per-rank randomness (dropout, augmentation: torch, numpy or `random`) from the data seed.
    rng.seed_all(data_seed(plan.trial_seed, topo.host_rank, topo.local_rank))

    # 2. Data: training files sharded over hosts, eval rows over ranks.
    local_batch = tr.batch_size // topo.world_size
    my_data_seed = data_seed(plan.trial_seed, topo.host_rank, topo.local_rank)
    opened_before = len(files.OPENED)
    train_files = list_files(study.data.train)
    shard = train_shard(train_files, topo.num_hosts, topo.host_rank, topo.workers_per_host, topo.local_rank)
    stream = TrainStream(
        workload,
        shard,
        local_batch,
        my_data_seed,
        study.input.shuffle_window_row_groups,
        cache_bytes=study.input.cache_mb << 20,
    )
    unused = ",".join(unused_columns(workload, shard))
    val_files = list_files(study.data.validation)
    val_ranges = row_ranges(val_files, topo.world_rank, topo.world_size)
    sample = plan_sample(sum(f.num_rows for f in val_files), tr, topo.world_rank, topo.world_size)
    train_part = train_eval_part(train_files, tr, topo)
    eval_local_batch = tr.resolved_eval_batch_size // topo.world_size
    if tr.resolved_eval_batch_size < tr.batch_size:
        rank0.run(
            print,
            f"[{plan.trial_name}] warning: eval_batch_size {tr.eval_batch_size} < "
            f"batch_size {tr.batch_size} ({tr.eval_batch_size_reason})",
            flush=True,
        )
    # 3. Resume from the latest checkpoint: weights, optimizer, step, RNG, history.
    state = reporter.restore() or TrialState()
    if state.model:
        model.load_state_dict(state.model)
        optimizer.load_state_dict(state.optimizer)
        if len(state.rng_states) == topo.world_size:
            rng.restore(state.rng_states[topo.world_rank])
        else:  # the ranks' draws cannot continue as before: the run is no longer bitwise
            rank0.run(
                print,
                f"[{plan.trial_name}] warning: resumed on {topo.world_size} ranks from a checkpoint "
                f"of {len(state.rng_states)}; random draws restart from the data seeds",
                flush=True,
            )
    step, history = state.step, list(state.history)
    metrics_log = MetricsLog(plan.metrics_uri)  # its first write replaces the log whole
    records = topology_record.gather(
        topology_record.rank_record(
            topo,
            init_seed(plan.trial_seed),
            my_data_seed,
            init_params,
            sorted(set(files.OPENED[opened_before:])),
            stream.batch(0)["example_id"],
            resumed_from_step=step,
        )
    )
    rank0.run(topology_record.write, plan.topology_uri, plan.trial_name, study.scaling.num_hosts, records)

    tally = StepTally(device)
    sync_debug = step_sync_debug(study.input, device)
    # steps_per_s: the clock of the first interval starts once the first batch is in hand
    # (the loader's start-up is start-up, not step time: InputTimer leaves it out too).
    interval_start: float | None = None
    steps_in_interval = 0
    pin = torch.device(device).type == "cuda"  # pinned host batches: non_blocking copies really are
    batches = (batch_source or local_batches(study.input.prefetch_batches, pin))(stream, step)
    timer = InputTimer()
    profiler = StepProfiler(
        plan.layout.profile_trace,
        study.input.profile_steps,
        first_step=step + 1,
    )
    while step < max_steps:
        lr = plan.learning_rate(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        rank0.run(profiler.before_step, step)
        timer.begin_step()
        if sync_debug:
            torch.cuda.set_sync_debug_mode(sync_debug)
        batch = {k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
        timer.got_batch()
        if interval_start is None:
            interval_start = time.perf_counter()
        loss = workload.loss(workload.forward(ddp, batch), batch).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        steps_in_interval += 1
        tally.add(loss, step)  # on the device: no read back to the host inside the step
        if sync_debug:
            torch.cuda.set_sync_debug_mode("default")
        timer.end_step()
        rank0.run(profiler.after_step, step)
        if step % tr.eval_every_steps and step != max_steps:
            continue

        # 4. Evaluation point: read the interval's loss tally (the one host sync of the
        # interval), agree on divergence, sync BN stats, evaluate, checkpoint, report.
        loss_sum, loss_count, first_bad_step = tally.take()
        elapsed_s = time.perf_counter() - interval_start
        bad_flag = 0.0 if math.isinf(first_bad_step) else 1.0
        reduce_start = time.perf_counter()
        loss_total, loss_n, bad, *input_s = all_reduce_sum(
            [loss_sum, loss_count, bad_flag, *timer.take(), *stream.stats.take()], device
        )
        reduce_s = time.perf_counter() - reduce_start
        row = {
            "step": step,
            "learning_rate": lr,
            "train/loss": loss_total / loss_n if loss_n else math.nan,
            "steps_per_s": steps_in_interval / max(elapsed_s, 1e-9),
            **input_fields(input_s, unused),
            "multihost/reduce_s": reduce_s,  # this rank's wait in the metric all-reduce
        }
        if bad:  # every rank agrees (a reduced value), so every rank takes this branch
            diverged_at = int(all_reduce_min(first_bad_step, device))
            row.update({"status": "diverged", "diverged_at_step": diverged_at, tr.metric: worst(tr.mode)})
            rank0.run(
                print, f"[{plan.trial_name}] diverged: non-finite loss at step {diverged_at}", flush=True
            )
            history.append(row)
            rank0.run(metrics_log.write, history)
            reporter.report(row, None)
            break
        sync_start = time.perf_counter()
        sync_batchnorm_stats(model)
        row["multihost/bn_sync_s"] = time.perf_counter() - sync_start
        row.update(
            run_evals(
                plan, workload, model, topo, val_ranges, sample, eval_local_batch, step, max_steps, device
            )
        )
        if train_part is not None:
            row.update(train_eval_fields(workload, model, train_part, eval_local_batch, device))
        history.append(row)
        best = best_row(history, tr.metric, tr.mode)
        report = {  # flat scalars only: per-class details stay in the metrics log
            **{k: v for k, v in row.items() if not k.endswith("/per_class")},
            "status": "running" if step < max_steps else "finished",
            "best_step": best["step"],
            "best_metric": best[tr.metric],
        }
        rng_states = gather_rng_states()
        state = TrialState(
            step, model.state_dict(), optimizer.state_dict(), rng_states, history, dict(plan.hparams)
        )
        if checkpointer is not None:
            rank0.run(checkpointer.save, state, report)
            rank0.run(metrics_log.write, history)
            reporter.report(report, None)
        else:
            with tempfile.TemporaryDirectory(prefix="playbook-ckpt-") as tmp:
                saved = rank0.run(save_checkpoint, state, tmp, report)
                rank0.run(metrics_log.write, history)
                reporter.report(report, saved)
        steps_in_interval = 0
        interval_start = time.perf_counter()

    rank0.run(profiler.close)  # a trial that ended inside its profiled steps
    best = best_row(history, tr.metric, tr.mode)
    return {
        "trial_name": plan.trial_name,
        "last_step": step,
        "history": history,
        "status": history[-1].get("status", "finished") if history else "finished",
        "best_step": best["step"] if best else None,
        "best_metric": best[tr.metric] if best else None,
    }


def train_eval_part(train_files, tr, topo: Topology) -> tuple[list, torch.Tensor | None] | None:
    """This rank's rows of the fixed training sample evaluated at every eval point
    (`training.train_eval_sample_size`): (row ranges, positions kept in them or None for all)."""
    if tr.train_eval_sample_size is None:
        return None
    total = sum(f.num_rows for f in train_files)
    sample = sample_of(total, tr.train_eval_sample_size, tr.seed, topo.world_rank, topo.world_size)
    return row_ranges(train_files, topo.world_rank, topo.world_size), sample.local_keep if sample else None


def train_eval_fields(workload, model, part, batch_size, device) -> dict:
    """The training sample evaluated exactly like validation (eval mode, padded batches,
    weighted sums over all ranks): `train_eval/<metric>`."""
    ranges, keep = part
    result = evaluate(model, workload, eval_batches(workload, ranges, batch_size, keep), batch_size, device)
    return {f"train_eval/{k}": v for k, v in result.items() if k != "per_class"}


def run_evals(plan, workload, model, topo, val_ranges, sample, batch_size, step, max_steps, device) -> dict:
    """The evaluations of one eval point: the full validation set, or its fixed sample plus
    (at the end and every full_eval_every_steps) the full set and the sample's bias."""
    tr, rank0 = plan.study.training, Rank0(topo)
    metric_name = tr.metric.split("/", 1)[1]

    def one(keep, split: str, prefix: str) -> tuple[dict, dict | None]:
        log = PredictionLog(workload.metric_names, workload.num_classes)
        val = evaluate(
            model, workload, eval_batches(workload, val_ranges, batch_size, keep), batch_size, device, log
        )
        rows = log.gather()
        rank0.run(write_predictions, plan.predictions_uri(split, step), rows, split, step)
        return {f"{prefix}/{k}": v for k, v in val.items()}, rows

    if sample is None:
        return one(None, "validation", "validation")[0]
    fields, _ = one(sample.local_keep, "validation-sample", "validation")
    if is_full_eval(step, max_steps, tr):
        full, rows = one(None, "validation", "validation_full")
        fields.update(full)
        if rows is not None:  # rank 0
            bias = bias_fields(rows, sample, metric_name)
            fields.update({f"validation_full/{k}": v for k, v in bias.items()})
            if bias["sample_biased"]:
                print(
                    f"[{plan.trial_name}] warning: the validation sample is biased at step {step}: "
                    f"{tr.metric} sample - full = {bias['sample_gap']:+.4g}, more than sampling "
                    f"noise explains (95% CI [{bias['sample_gap_ci_low']:+.4g}, "
                    f"{bias['sample_gap_ci_high']:+.4g}])",
                    flush=True,
                )
    return fields


TIMING_FIELDS = (
    "steps_per_s",
    "input/exposed_fraction",
    "input/wait_s",
    "input/step_s",
    "input/read_s",
    "input/preprocess_s",
    "multihost/reduce_s",
    "multihost/bn_sync_s",
)
"""Metrics-log fields that are wall-clock measurements: they differ between identical runs (the
`multihost/*` ones also between the ranks of one run: each rank times its own collective)."""


def input_fields(sums: list[float], unused: str) -> dict:
    """The interval's input timings, summed over ranks (see `service.analysis.input_bound`)."""
    wait_s, step_s, read_s, preprocess_s = sums
    return {
        "input/exposed_fraction": wait_s / step_s if step_s > 0 else 0.0,
        "input/wait_s": wait_s,
        "input/step_s": step_s,
        "input/read_s": read_s,
        "input/preprocess_s": preprocess_s,
        "input/unused_columns": unused,
    }


def save_checkpoint(state: TrialState, directory: str, metrics: dict) -> str:
    checkpoint.save(state, directory, metrics)
    return directory


def write_predictions(uri: str, rows: dict, split: str, step: int) -> None:
    prediction_files.write(uri, rows, split, step)
