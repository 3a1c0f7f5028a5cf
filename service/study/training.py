"""The study file's sections that say how every trial trains: `data:` (the splits' URIs),
`scaling:` (hosts and workers per trial) and `training:` (steps, batch sizes, evaluation,
optimizer, its learning-rate `schedule:`, precision). Each field's default and docstring live
here; `service.study.spec` assembles them into the Study."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from service.study.strict import non_negative as _non_negative
from service.study.strict import positive as _positive


@dataclass(frozen=True)
class Data:
    train: str
    """URI of the training parquet files: a directory, a glob, or one file (any fsspec URI)."""
    validation: str
    """URI of the validation parquet files; evaluated every `training.eval_every_steps`."""
    test: str | None = None
    """URI of the held-out test files; only `playbook eval` reads them."""
    allow_overlap: bool = False
    """Examples of the training split whose id (the workload's id column) is also in the
    validation or test split are refused at `playbook validate --data` and at run start; true
    lets them through with a warning giving their count (an intended overlap)."""


@dataclass(frozen=True)
class Scaling:
    num_hosts: int = 1
    """Hosts (Ray nodes) per trial."""
    workers_per_host: int = 1
    """Training worker processes per host (one per GPU when `use_gpu`)."""
    use_gpu: bool = False
    """One GPU per worker and NCCL; otherwise CPU and gloo."""
    cpus_per_worker: float = 1.0
    """CPUs reserved for each worker."""
    reuse_workers: bool = True
    """Multi-worker trials: a Tune run's trials share one pool of worker processes and their
    process group (gloo, or NCCL with `use_gpu`), started with the run's first trial (no Ray
    Train start-up per trial); a failed trial's pool is replaced. Off: one Ray Train run per
    trial."""
    collective_timeout_s: float = 300.0
    """Seconds a collective (an all-reduce, a gather: gloo or NCCL) waits for its slowest rank
    before it fails, and with it the worker group, which Ray Train restarts from the latest
    checkpoint: how long a trial can hang on a rank whose host dropped off the network (Ray
    Train's `TorchConfig.timeout_s`, whose default is 1800). It must exceed the longest time one
    rank works alone while the others wait in a collective: rank 0 writing an eval point's
    predictions, a slow first read of a rank's data."""

    strategy: Literal["ddp", "fsdp"] = "ddp"
    """How a multi-worker trial spreads its model. `ddp`: every worker holds the whole model,
    its gradients and optimizer state, and gradients are all-reduced. `fsdp`: FSDP2 shards the
    parameters, gradients and optimizer state over the workers (each holds about 1/N of them,
    gathered unit by unit for forward and backward) and checkpoints are sharded, one file per
    worker (docs/large-models.md)."""
    find_unused_parameters: bool = False
    """ddp only: a model whose steps leave some parameters without a gradient (a branch a step
    does not take). DDP's own option of that name: every step walks the autograd graph for the
    parameters it did not use (and all-reduces one more small map), and DDP says once per
    worker if it found none. Off, a step that leaves a parameter without a gradient fails the
    trial at once, in one line naming this field and the parameters."""
    shard_group_size: int | None = None
    """fsdp only: the workers each parameter is sharded over; the trial's workers form
    world_size / shard_group_size replicas of the sharded model (HSDP: a 2-D device mesh,
    gradients reduce-scattered within a group and all-reduced across groups). Default: every
    worker (plain FSDP). `workers_per_host` shards within each host and replicates across
    hosts, so parameter gathers stay on a host's fast links."""

    def errors(self):
        yield from _positive(self, "num_hosts", "workers_per_host", "cpus_per_worker", "collective_timeout_s")
        yield from _positive(self, "shard_group_size")
        if self.strategy == "fsdp" and self.world_size == 1:
            yield "strategy", "fsdp shards over a trial's workers, and this trial has 1 (use ddp)"
        if self.find_unused_parameters and self.strategy != "ddp":
            yield "find_unused_parameters", f"only applies to strategy: ddp (strategy is {self.strategy})"
        if self.shard_group_size is None or self.shard_group_size <= 0:
            return
        if self.strategy != "fsdp":
            yield "shard_group_size", f"only applies to strategy: fsdp (strategy is {self.strategy})"
        elif self.shard_group_size == 1:
            yield "shard_group_size", "1 shards nothing: every worker would hold the whole model (use ddp)"
        elif self.world_size % self.shard_group_size:
            yield (
                "shard_group_size",
                f"must divide the trial's {self.world_size} workers (num_hosts * workers_per_host) "
                f"into whole replicas (got {self.shard_group_size})",
            )

    @property
    def resolved_shard_group_size(self) -> int:
        """The workers each parameter is sharded over under fsdp (all of them by default)."""
        return self.shard_group_size or self.world_size

    @property
    def world_size(self) -> int:
        return self.num_hosts * self.workers_per_host


@dataclass(frozen=True)
class Schedule:
    kind: Literal["constant", "linear", "cosine"] = "cosine"
    """Learning-rate schedule after warmup: constant, linear decay, or cosine decay."""
    warmup_steps: int = 0
    """Linear warmup from 0 to the base learning rate over this many steps."""
    decay_steps: int | None = None
    """linear only: length of the decay phase at the end of training (default: all steps after
    warmup). Round 2 keeps this length and lengthens the constant phase before it."""
    final_lr_fraction: float = 0.0
    """Learning rate reached at the end of training (step max_train_steps), as a fraction of
    the base learning rate; the last update uses the value one step before."""

    def errors(self):
        yield from _non_negative(self, "warmup_steps", "final_lr_fraction")
        if self.decay_steps is not None and self.decay_steps <= 0:
            yield "decay_steps", f"must be > 0 (got {self.decay_steps})"
        if self.decay_steps is not None and self.kind != "linear":
            yield "decay_steps", f"only applies to kind: linear (kind is {self.kind})"
        if self.final_lr_fraction > 1:
            yield "final_lr_fraction", f"must be <= 1 (got {self.final_lr_fraction})"
        if self.final_lr_fraction and self.kind == "constant":
            yield (
                "final_lr_fraction",
                "only applies to kind: linear or cosine (a constant schedule does not decay)",
            )


@dataclass(frozen=True)
class Training:
    max_train_steps: int
    """Optimizer steps per trial. Fixed: every trial trains exactly this long (no early stop)."""
    batch_size: int
    """Global training batch size, split evenly over all workers."""
    eval_every_steps: int
    """Evaluate on the validation set (and checkpoint) every this many steps and at the end."""
    eval_batch_size: int | None = None
    """Global evaluation batch size; defaults to `batch_size` and may not be smaller (evaluation
    needs no activations for backprop, so it fits at least the training batch) unless
    `eval_batch_size_reason` says why."""
    eval_batch_size_reason: str | None = None
    """Why `eval_batch_size` is smaller than `batch_size` (allows it, with a warning in the log)."""
    validation_sample_size: int | None = None
    """Evaluate periodically on a fixed random sample of this many validation examples (the same
    sample for the whole study); the full set is evaluated at the end and every
    `full_eval_every_steps`, and the sample's bias is checked there."""
    full_eval_every_steps: int | None = None
    """With `validation_sample_size`: also evaluate the full validation set this often."""
    train_eval_sample_size: int | None = None
    """Also evaluate a fixed sample of this many training examples (all of them if fewer) at
    every eval point, in eval mode like validation: `train_eval/<metric>` in the metrics log.
    How well the model fits the training set; `playbook find-steps` sets it."""
    num_checkpoints_to_keep: int = 3
    """Keep the N best checkpoints by `metric` (plus the latest, for resuming)."""
    metric: str = "validation/error"
    """The validation metric that ranks checkpoints and trials."""
    mode: Literal["min", "max"] = "min"
    """Whether lower (`min`) or higher (`max`) `metric` is better."""
    seed: int = 0
    """Study seed: every trial's init seed and per-host data seeds derive from it."""
    optimizer: Literal["sgd_momentum", "nesterov", "adamw", "workload"] = "nesterov"
    """Optimizer; its hyperparameters (learning_rate, momentum, ...) come from `search`.
    `workload`: the workload's own (`Workload.optimizer`), which must read every optimizer
    hyperparameter the trial sets (checked when a trial builds it)."""
    schedule: Schedule = field(default_factory=Schedule)
    """Learning-rate schedule."""
    ghost_batch_norm: bool = False
    """Replace the workload's BatchNorm layers by ghost batch norm: training statistics over
    virtual batches of exactly `virtual_batch_size` examples, each worker's batch split into
    virtual batches or, when smaller, the batches of a group of consecutive workers making one."""
    virtual_batch_size: int = 64
    """Examples per virtual batch for ghost batch norm (the playbook's anecdote: 64). The
    per-worker batch must be a multiple of it, or a whole fraction of it whose groups of workers
    divide the workers."""
    async_checkpoint: bool = True
    """Single-worker and fsdp trials: write checkpoints on a background thread (training stalls
    only for a memory copy of the state, under fsdp of each worker's shards). Multi-worker ddp
    trials save synchronously through Ray Train."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Forward passes (training and evaluation) under torch.autocast in this dtype on the
    trial's device; fp16 adds a gradient scaler, saved in the checkpoint. Weights, optimizer
    state and metric sums stay float32/float64."""
    microbatch_size: int | None = None
    """Gradient accumulation: each worker's batch (batch_size / workers) goes through forward
    and backward this many rows at a time, with one optimizer update and one all-reduce per
    step; must divide the per-worker batch. BatchNorm then normalises over microbatches."""
    compile: bool = False
    """torch.compile the model (in place: the checkpoint is the same as without)."""

    def errors(self):
        yield from _positive(self, "max_train_steps", "batch_size", "eval_every_steps")
        yield from _positive(self, "num_checkpoints_to_keep", "virtual_batch_size", "microbatch_size")
        yield from _non_negative(self, "seed")
        if self.eval_batch_size is not None:
            yield from _positive(self, "eval_batch_size")
            if self.eval_batch_size < self.batch_size and not self.eval_batch_size_reason:
                yield (
                    "eval_batch_size",
                    f"must be >= batch_size ({self.eval_batch_size} < {self.batch_size}); "
                    "set eval_batch_size_reason to allow it",
                )
        yield from _positive(
            self, "validation_sample_size", "full_eval_every_steps", "train_eval_sample_size"
        )
        if self.full_eval_every_steps is not None and self.validation_sample_size is None:
            yield "full_eval_every_steps", "only applies with validation_sample_size"
        if self.eval_every_steps > self.max_train_steps:
            yield (
                "eval_every_steps",
                (f"must be <= max_train_steps ({self.eval_every_steps} > {self.max_train_steps})"),
            )
        if "/" not in self.metric:
            yield "metric", f"must look like 'validation/<name>' (got {self.metric!r})"
        for path, msg in self.schedule.errors():
            yield f"schedule.{path}", msg
        if self.schedule.warmup_steps >= self.max_train_steps:
            yield "schedule.warmup_steps", "must be < max_train_steps"
        if (self.schedule.decay_steps or 0) + self.schedule.warmup_steps > self.max_train_steps:
            yield "schedule.decay_steps", "warmup_steps + decay_steps must be <= max_train_steps"

    @property
    def resolved_eval_batch_size(self) -> int:
        return self.eval_batch_size or self.batch_size
