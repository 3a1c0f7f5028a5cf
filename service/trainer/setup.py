"""A trial's set-up on one rank (the playbook's order: 1. model and optimizer, 2. data and eval
plan) into the `TrialContext` every later part of the step loop reads, and the `Progress` a
restore starts from."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from service import workloads
from service.data import files
from service.data.files import list_files
from service.data.input_timer import InputTimer
from service.data.loader import TrainStream, unused_columns
from service.data.sharding import RowRange, row_ranges, train_shard
from service.distributed import sharding, topology_record
from service.distributed.rank0 import Rank0
from service.distributed.topology import Topology, data_seed, init_seed
from service.evaluation.sampling import EvalSample, plan_sample, sample_of
from service.nn.ghost_batchnorm import convert_to_ghost, ghost_group
from service.planning.trial import TrialPlan
from service.study.search import CLIP_HPARAM
from service.study.training import Training
from service.trainer import rng
from service.trainer.gradients import Gradients
from service.trainer.metrics_log import MetricsLog
from service.trainer.optimizers import workload_optimizer
from service.trainer.precision import DTYPES, Precision
from service.trainer.tally import StepTally, distributed
from service.workloads.base import Workload

COMPILE_BACKEND = "inductor"
"""torch.compile's backend with `training.compile: true` (a test may pick a cheaper one)."""


def step_sync_debug(inp, device) -> str | None:
    """`input.sync_debug` on a CUDA device: torch's sync debug mode during each training step
    ("warn": one warning naming the Python line of each device-to-host sync). Off elsewhere."""
    return "warn" if inp.sync_debug and torch.device(device).type == "cuda" else None


@dataclass
class EvalPlan:
    """What this rank evaluates at every eval point."""

    val_ranges: list[RowRange]  # this rank's rows of the validation files
    sample: EvalSample | None  # the fixed validation sample, or None: the full set every time
    train_part: tuple[list[RowRange], torch.Tensor | None] | None  # see `train_eval_part`
    batch_size: int  # this rank's eval batch


@dataclass
class TrialContext:
    """One trial on this rank as `set_up` builds it: what every later part of the loop reads."""

    plan: TrialPlan
    topo: Topology
    device: torch.device
    workload: Workload
    rank0: Rank0
    max_steps: int
    model: nn.Module
    trained: nn.Module  # the model as trained: in DDP, or the model (FSDP shards it in place)
    optimizer: torch.optim.Optimizer
    init_params: str  # the initial weights' sha256 (the topology record)
    data_seed: int
    opened_before: int  # data files this process had opened before set-up (the topology record)
    stream: TrainStream
    unused_columns: str
    evals: EvalPlan
    metrics_log: MetricsLog
    tally: StepTally
    timer: InputTimer
    sync_debug: str | None
    clip_norm: float | None  # grad_clip_norm: clip the gradients' global norm to this
    gradients: Gradients  # the step's gradients (one buffer on CPU) and their global norm
    precision: Precision  # training.precision: autocast, and fp16's gradient scaler
    microbatch_size: int | None  # training.microbatch_size: rows per forward/backward (None: the batch)
    unchecked_gradients: bool  # DDP without find_unused_parameters, before its first step's check

    @property
    def training(self) -> Training:
        return self.plan.study.training


def set_up(plan: TrialPlan, topo: Topology, device) -> TrialContext:
    """1. The model and optimizer, seeded alike on every rank; 2. this rank's training stream
    and eval plan; the loop's instruments (loss tally, input timer, metrics log)."""
    study, tr = plan.study, plan.study.training
    workload = workloads.get(study.workload)
    model, trained, optimizer, init_params = build_model(plan, topo, workload, device)
    # Per-rank randomness (dropout, augmentation: torch, numpy or `random`) from the data seed.
    rng.seed_all(data_seed(plan.trial_seed, topo.host_rank, topo.local_rank))

    # 2. Data: training files sharded over hosts, eval rows over ranks.
    my_data_seed = data_seed(plan.trial_seed, topo.host_rank, topo.local_rank)
    opened_before = len(files.OPENED)
    train_files = list_files(study.data.train)
    shard = train_shard(train_files, topo.num_hosts, topo.host_rank, topo.workers_per_host, topo.local_rank)
    return TrialContext(
        plan=plan,
        topo=topo,
        device=device,
        workload=workload,
        rank0=Rank0(topo),
        max_steps=plan.max_train_steps or tr.max_train_steps,
        model=model,
        trained=trained,
        optimizer=optimizer,
        init_params=init_params,
        data_seed=my_data_seed,
        opened_before=opened_before,
        stream=train_stream(plan, topo, workload, shard, my_data_seed),
        unused_columns=",".join(unused_columns(workload, shard)),
        evals=plan_evals(plan, topo, train_files),
        metrics_log=MetricsLog(plan.metrics_uri),  # its first write replaces the log whole
        tally=StepTally(device),
        timer=InputTimer(),
        sync_debug=step_sync_debug(study.input, device),
        clip_norm=clip_norm(plan.hparams),
        gradients=Gradients(model, buffer=not distributed() and tr.optimizer != "workload"),
        precision=Precision(tr.precision, device, autocast=not sharding.is_sharded(model)),
        microbatch_size=tr.microbatch_size,
        unchecked_gradients=isinstance(trained, nn.parallel.DistributedDataParallel)
        and not trained.find_unused_parameters,
    )


def train_stream(plan: TrialPlan, topo: Topology, workload, shard, seed: int) -> TrainStream:
    """This rank's training stream: per-worker batches of batch_size / workers from its shard."""
    study = plan.study
    return TrainStream(
        workload,
        shard,
        study.training.batch_size // topo.world_size,
        seed,
        study.input.shuffle_window_row_groups,
        cache_bytes=study.input.cache_mb << 20,
        hparams=plan.hparams,
        shuffle_window_bytes=study.input.shuffle_window_mb << 20,
    )


def clip_norm(hparams: dict) -> float | None:
    value = hparams.get(CLIP_HPARAM)
    return None if value is None else float(value)


def build_model(plan: TrialPlan, topo: Topology, workload, device):
    """1. Model: the same init seed on every rank -> bit-identical initial weights.
    Returns (model, the model as trained, optimizer, sha256 of the initial weights)."""
    tr = plan.study.training
    torch.manual_seed(init_seed(plan.trial_seed))
    model = workload.build_model(plan.hparams).to(device)
    if tr.ghost_batch_norm:  # BN statistics over virtual batches of each forward pass's rows
        group = ghost_group(tr.microbatch_size or tr.batch_size // topo.world_size, tr.virtual_batch_size)
        convert_to_ghost(model, tr.virtual_batch_size, group)
    init_params = topology_record.params_sha256(model)
    if tr.compile:  # in place: the module (its state_dict keys, the checkpoint) is the same one
        model.compile(backend=COMPILE_BACKEND)
    trained = spread(model, plan.study, workload, device) if distributed() else model
    optimizer = workload_optimizer(tr.optimizer, workload, model, plan.hparams)  # over the shards under fsdp
    return model, trained, optimizer, init_params


def spread(model: nn.Module, study, workload, device) -> nn.Module:
    """The model over the trial's workers as `scaling.strategy` says: DDP replicas, or FSDP2
    shards of the workload's units (in place; bf16 parameters in forward and backward under
    `training.precision: bf16`)."""
    if study.scaling.strategy == "ddp":
        return wrap_ddp(model, device, study.scaling.find_unused_parameters)
    mesh = sharding.device_mesh(device, study.scaling.resolved_shard_group_size)
    param_dtype = DTYPES.get(study.training.precision)
    return sharding.shard_model(model, workload.shard_units(model), mesh, param_dtype)


def wrap_ddp(model: nn.Module, device, find_unused_parameters: bool = False) -> nn.Module:
    """DDP; on CPU, with buckets that never change. DDP rebuilds its buckets after its first
    step, in the order the gradients became ready: the first step after every restart would
    all-reduce another layout than the same step of an uninterrupted run, and with 3 or more
    ranks the float sums of a gradient would run in another order (gloo's ring sums a bucket
    in chunks by position; a resumed run would not end bitwise equal). On CPU every process
    instead hands DDP all its parameters, in their order, as the order to rebuild by (what
    DDP's own Join hook does for a rank that has no backward pass): DDP rebuilds its buckets
    from that order as its first forward pass starts and never again, so every step of every
    process, restarted or not, all-reduces the same layout. With `find_unused_parameters`
    (`scaling.find_unused_parameters`) DDP never rebuilds its first layout. On GPU, where
    results are not bitwise anyway, DDP keeps its own buckets."""
    ddp = nn.parallel.DistributedDataParallel(
        model, broadcast_buffers=False, find_unused_parameters=find_unused_parameters
    )
    if torch.device(device).type == "cpu" and not find_unused_parameters:
        ddp.reducer._push_all_rebuilt_params()
    return ddp


def plan_evals(plan: TrialPlan, topo: Topology, train_files) -> EvalPlan:
    """This rank's validation rows, the fixed samples and the eval batch."""
    tr = plan.study.training
    val_files = list_files(plan.study.data.validation)
    val_ranges = row_ranges(val_files, topo.world_rank, topo.world_size)
    sample = plan_sample(sum(f.num_rows for f in val_files), tr, topo.world_rank, topo.world_size)
    train_part = train_eval_part(train_files, tr, topo)
    evals = EvalPlan(val_ranges, sample, train_part, tr.resolved_eval_batch_size // topo.world_size)
    if tr.resolved_eval_batch_size < tr.batch_size:
        Rank0(topo).run(
            print,
            f"[{plan.trial_name}] warning: eval_batch_size {tr.eval_batch_size} < "
            f"batch_size {tr.batch_size} ({tr.eval_batch_size_reason})",
            flush=True,
        )
    return evals


def train_eval_part(train_files, tr, topo: Topology) -> tuple[list, torch.Tensor | None] | None:
    """This rank's rows of the fixed training sample evaluated at every eval point
    (`training.train_eval_sample_size`): (row ranges, positions kept in them or None for all)."""
    if tr.train_eval_sample_size is None:
        return None
    total = sum(f.num_rows for f in train_files)
    sample = sample_of(total, tr.train_eval_sample_size, tr.seed, topo.world_rank, topo.world_size)
    return row_ranges(train_files, topo.world_rank, topo.world_size), sample.local_keep if sample else None


@dataclass
class Progress:
    """Where the trial stands: its step, its eval rows so far, and the current eval interval."""

    step: int
    history: list[dict]
    lr: float = math.nan  # the last step's learning rate
    steps_in_interval: int = 0
    # steps_per_s: the clock of the first interval starts once the first batch is in hand
    # (the loader's start-up is start-up, not step time: InputTimer leaves it out too).
    interval_start: float | None = None
