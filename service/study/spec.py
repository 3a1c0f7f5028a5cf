"""The study file: YAML -> frozen dataclasses. Defaults live here and nowhere else.

The loader is strict: an unknown key, a missing required key, a wrong type or an impossible
value raises `SpecError` whose message starts with the dotted path of the field, e.g.
``training.eval_every_steps: must be > 0 (got 0)``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Literal

import yaml

from service.core import storage
from service.core.errors import SpecError
from service.study.layout import StudyLayout
from service.study.sections import Budget, Curves, FindSteps, InputPipeline, Tracking
from service.study.strict import Scalar, build, load_yaml
from service.study.strict import non_negative as _non_negative
from service.study.strict import positive as _positive

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
# Schedule fields a hyperparameter may set for its trial (searched or fixed in `search`), and
# the schedule kinds that read each.
SCHEDULE_HPARAMS = {
    "warmup_steps": ("constant", "linear", "cosine"),
    "decay_steps": ("linear",),
    "final_lr_fraction": ("linear", "cosine"),
}
# The optimizers that read each optimizer-specific hyperparameter.
READ_BY_OPTIMIZERS = {
    "momentum": ("sgd_momentum", "nesterov"),
    "beta1": ("adamw",),
    "beta2": ("adamw",),
    "eps": ("adamw",),
}
# Read by the step loop whatever the optimizer: gradient clipping by global norm.
CLIP_HPARAM = "grad_clip_norm"
# Hyperparameters the trainer itself consumes; every other name goes to the workload.
OPTIMIZER_HPARAMS = ("learning_rate", "weight_decay", CLIP_HPARAM, *READ_BY_OPTIMIZERS, *SCHEDULE_HPARAMS)
DEFAULT_STEP_MULTIPLIER = 2.0


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
    reuse_workers: bool = False
    """Multi-worker CPU trials: a Tune run's trials share one pool of worker processes and
    their process group, started with the run's first trial (no Ray Train start-up per
    trial); a failed trial's pool is replaced. Off: one Ray Train run per trial."""
    collective_timeout_s: float = 300.0
    """Seconds a collective (an all-reduce, a gather: gloo or NCCL) waits for its slowest rank
    before it fails, and with it the worker group, which Ray Train restarts from the latest
    checkpoint: how long a trial can hang on a rank whose host dropped off the network (Ray
    Train's `TorchConfig.timeout_s`, whose default is 1800). It must exceed the longest time one
    rank works alone while the others wait in a collective: rank 0 writing an eval point's
    predictions, a slow first read of a rank's data."""

    def errors(self):
        yield from _positive(self, "num_hosts", "workers_per_host", "cpus_per_worker", "collective_timeout_s")

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
    """Single-worker trials: write checkpoints on a background thread (training stalls only for
    a memory copy of the state). Multi-worker trials save synchronously through Ray Train."""
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


@dataclass(frozen=True)
class HParam:
    role: Literal["scientific", "nuisance", "fixed"]
    """Scientific: what the study compares. Nuisance: optimised away per scientific value.
    Fixed: held constant in this study (give `value`)."""
    type: Literal["float", "int", "choice"] = "float"
    """Searched dimension kind: a float or int range [min, max], or a choice among `values`."""
    min: float | None = None
    """Lower bound (inclusive) of a float/int range."""
    max: float | None = None
    """Upper bound (inclusive) of a float/int range."""
    scale: Literal["linear", "log"] = "linear"
    """Sample the range uniformly (linear) or uniformly in log space (log)."""
    values: tuple[Scalar, ...] | None = None
    """The options of a `choice` dimension."""
    value: Scalar | None = None
    """The value of a `fixed` hyperparameter."""

    def errors(self):
        if self.role == "fixed":
            if self.value is None:
                yield "value", "required when role is fixed"
            for name in ("min", "max", "values"):
                if getattr(self, name) is not None:
                    yield name, "not allowed when role is fixed (give value only)"
            return
        if self.value is not None:
            yield "value", f"only for role fixed (role is {self.role})"
        if self.type == "choice":
            if not self.values:
                yield "values", "required (non-empty) for type choice"
            if self.min is not None or self.max is not None:
                yield "min", "not allowed for type choice"
            return
        if self.values is not None:
            yield "values", f"only for type choice (type is {self.type})"
        for name in ("min", "max"):
            if getattr(self, name) is None:
                yield name, f"required for type {self.type}"
        if self.min is None or self.max is None:
            return
        if self.min > self.max:
            yield "min", f"must be <= max ({self.min} > {self.max})"
        if self.scale == "log" and self.min <= 0:
            yield "min", f"must be > 0 for scale log (got {self.min})"
        if self.type == "int" and (self.min != int(self.min) or self.max != int(self.max)):
            yield "min", "bounds of an int dimension must be integers"

    @property
    def searched(self) -> bool:
        return self.role != "fixed"

    @property
    def extremes(self) -> tuple[Scalar, ...]:
        """The values that bound what a trial can get: the fixed value, every choice, or the
        range's two ends."""
        if self.role == "fixed":
            return (self.value,)
        return tuple(self.values) if self.type == "choice" else (self.min, self.max)


@dataclass(frozen=True)
class Round:
    name: str
    """Round name, used in trial names (`<round>-<index>`)."""
    num_trials: int
    """Trials in this round."""
    kind: Literal["quasi_random", "extend", "grid", "bayesian", "repeat"] = "quasi_random"
    """How trials are planned. `quasi_random`: scrambled Halton points over the search space
    (exploration). `extend` (the playbook's round 2): the best configuration of `from_round`
    rerun `num_trials` times (seeds training.seed, +1, ...) for longer, its learning-rate
    schedule extended by the playbook's rules. `grid`: every combination of the `values` of
    the searched choice dimensions (num_trials must equal the number of combinations).
    `bayesian` (exploitation): Optuna's TPE through Ray Tune, warm-started with the trials of
    `from_round`, one trial at a time (docs/study-file.md). `repeat`: the best trial of
    `from_round` for each scientific value rerun with `num_trials` other seeds, as long as it
    ran; its sentence says whether the best two values differ by more than seed noise."""
    max_concurrent_trials: int = 0
    """At most this many trials at once; 0 = as many as the cluster's resources allow."""
    max_train_steps: int | None = None
    """Override of `training.max_train_steps` for this round."""
    seed: int = 0
    """quasi_random: seed of the quasi-random sequence (its scrambling); bayesian: the sampler's."""
    from_round: str | None = None
    """extend: the round whose best trial is extended; bayesian: the round whose trials
    warm-start the sampler (default: the previous round)."""
    narrow_to_best: int = 0
    """bayesian only: search the range the best this-many finished trials of the source round
    span in each searched dimension (>= 2); 0 = the whole search space."""
    step_multiplier: float | None = None
    """extend only: max_train_steps of the trial it extends times this (default 2); not with
    max_train_steps."""
    trials_per_tune_run: int = 0
    """The round runs as consecutive Ray Tune runs of at most this many trials, because Tune
    keeps each trial's state in its process until the run ends (docs/performance.md); 0 =
    max(512, 32 x the round's concurrency), which bounds that memory and idles slots only at a
    run's tail."""

    @property
    def multiplier(self) -> float:
        return DEFAULT_STEP_MULTIPLIER if self.step_multiplier is None else self.step_multiplier

    def errors(self):
        if not NAME_RE.match(self.name):
            yield "name", f"must match {NAME_RE.pattern} (got {self.name!r})"
        yield from _positive(self, "num_trials", "step_multiplier")
        if self.kind != "extend" and self.step_multiplier is not None:
            yield "step_multiplier", f"only applies to kind: extend (kind is {self.kind})"
        if self.kind not in ("extend", "bayesian", "repeat") and self.from_round is not None:
            yield "from_round", f"only applies to kind: extend, bayesian or repeat (kind is {self.kind})"
        if self.kind == "repeat" and self.max_train_steps is not None:
            yield "max_train_steps", "a repeat round runs as long as the trials it repeats"
        if self.kind not in ("quasi_random", "bayesian") and self.seed:
            yield "seed", f"only applies to kind: quasi_random or bayesian (kind is {self.kind})"
        yield from self._bayesian_errors()
        if self.step_multiplier is not None and self.max_train_steps is not None:
            yield "step_multiplier", "give max_train_steps or step_multiplier, not both"
        yield from _non_negative(self, "max_concurrent_trials", "seed", "trials_per_tune_run")
        if self.max_train_steps is not None and self.max_train_steps <= 0:
            yield "max_train_steps", f"must be > 0 (got {self.max_train_steps})"

    def _bayesian_errors(self):
        if self.kind != "bayesian":
            if self.narrow_to_best:
                yield "narrow_to_best", f"only applies to kind: bayesian (kind is {self.kind})"
            return
        if self.narrow_to_best == 1 or self.narrow_to_best < 0:
            yield "narrow_to_best", f"must be 0 (whole space) or >= 2 (got {self.narrow_to_best})"
        if self.max_concurrent_trials > 1:
            yield "max_concurrent_trials", "a bayesian round runs one trial at a time (give 0 or 1)"


@dataclass(frozen=True)
class Study:
    name: str
    """Study name: lower-case letters, digits, '-' and '_'. Names the coordinator and storage."""
    workload: str
    """Built-in workload name (`digits`, `digits_zero`) or `package.module:Class`."""
    data: Data
    """Where the data lives."""
    training: Training
    """How every trial trains and evaluates."""
    search: dict[str, HParam]
    """The hyperparameters, each with its role; `learning_rate` is required."""
    rounds: tuple[Round, ...]
    """The rounds, run in order."""
    storage: str = "./playbook-studies"
    """Root URI for checkpoints, metrics and tracking (local path, gs://...); the study writes
    under `<storage>/<name>/`. Relative paths are resolved against the working directory."""
    description: str = ""
    """What this study is for (goes to the tracking table)."""
    scaling: Scaling = field(default_factory=Scaling)
    """Hosts and workers per trial."""
    find_steps: FindSteps | None = None
    """Settings of `playbook find-steps` (the max_train_steps finder)."""
    input: InputPipeline = field(default_factory=InputPipeline)
    """The input pipeline: prefetch depth, shuffle window, input-bound threshold, profiling."""
    tracking: Tracking = field(default_factory=Tracking)
    """Progress lines and the optional MLflow mirror."""
    budget: Budget | None = None
    """Compute-bound or not, and the compute-bound study's budget (unset: not said)."""
    curves: Curves = field(default_factory=Curves)
    """Thresholds of the training-curve verdicts (overfitting, late noise, still improving, ...)."""

    def errors(self):
        if not NAME_RE.match(self.name):
            yield "name", f"must match {NAME_RE.pattern} (got {self.name!r})"
        if "learning_rate" not in self.search:
            yield "search", "must define learning_rate (searched or fixed)"
        if not self.rounds:
            yield "rounds", "must list at least one round"
        earlier = [*self._round_errors(), *self._hparam_errors()]
        yield from earlier
        if not earlier:  # the lengths need well-formed rounds and schedule hyperparameters
            yield from self._schedule_length_errors()
        yield from self.budget.plan_errors(self) if self.budget else ()
        if self.training.batch_size % self.scaling.world_size:
            yield (
                "training.batch_size",
                (
                    f"must be divisible by num_hosts * workers_per_host "
                    f"({self.training.batch_size} % {self.scaling.world_size} != 0)"
                ),
            )
        if self.training.resolved_eval_batch_size % self.scaling.world_size:
            yield "training.eval_batch_size", "must be divisible by num_hosts * workers_per_host"
        if self.training.ghost_batch_norm:
            yield from _ghost_batch_errors(self.training, self.scaling.world_size)
        yield from _microbatch_errors(self.training, self.scaling.world_size)

    def _round_errors(self):
        names = [r.name for r in self.rounds]
        for i, name in enumerate(names):
            if name in names[:i]:
                yield f"rounds[{i}].name", f"duplicate round name {name!r}"
        for i, r in enumerate(self.rounds):
            if r.kind == "grid":
                dims = self.searched_hparams.values()
                if any(hp.type != "choice" for hp in dims):
                    yield f"rounds[{i}].kind", "grid needs every searched hyperparameter to be a choice"
                elif r.num_trials != math.prod(len(hp.values) for hp in dims):
                    yield f"rounds[{i}].num_trials", "must equal the number of grid combinations"
            if r.kind not in ("extend", "bayesian", "repeat"):
                continue
            if i == 0:
                what = "extend another round" if r.kind == "extend" else f"be {r.kind} (it needs a source)"
                yield f"rounds[{i}].kind", f"the first round cannot {what}"
            elif r.from_round is not None and r.from_round not in names[:i]:
                yield f"rounds[{i}].from_round", f"no earlier round named {r.from_round!r}"

    def _hparam_errors(self):
        """A hyperparameter the trainer would not read: an optimizer's own one with another
        optimizer, a schedule field the schedule's kind has no use for (or one also set in
        training.schedule, which it would override). Schedule fields must be step counts or
        fractions."""
        tr, schedule = self.training, self.training.schedule
        for name, hp in self.search.items():
            readers = READ_BY_OPTIMIZERS.get(name, (tr.optimizer,))
            if tr.optimizer not in (*readers, "workload"):
                yield (
                    f"search.{name}",
                    f"not read by optimizer {tr.optimizer} (only by {', '.join(readers)})",
                )
            if name == CLIP_HPARAM:
                yield from ((f"search.{name}", m) for m in _clip_value_errors(hp))
            if name not in SCHEDULE_HPARAMS:
                continue
            default = getattr(Schedule(), name)
            if getattr(schedule, name) != default:
                yield (
                    f"search.{name}",
                    f"also set in training.schedule.{name}, which this would override (set it in one place)",
                )
            if schedule.kind not in SCHEDULE_HPARAMS[name]:
                yield (
                    f"search.{name}",
                    f"not read by a {schedule.kind} schedule (training.schedule.kind; only by "
                    f"{', '.join(SCHEDULE_HPARAMS[name])})",
                )
            yield from ((f"search.{name}", m) for m in _schedule_value_errors(name, hp))

    def _schedule_length_errors(self):
        """Every round leaves room for the longest warmup (and, linear, warmup + decay) any of
        its trials can get; an extend round of a linear schedule is at least as long as the
        trial it extends (the decay phase keeps its length)."""
        w_field, w = self._longest("warmup_steps")
        d_field, d = self._longest("decay_steps")
        linear = self.training.schedule.kind == "linear"
        for i, r in enumerate(self.rounds):
            steps = self.round_steps(r)
            derived = r.kind == "extend" and r.max_train_steps is None
            here = f"rounds[{i}].{'step_multiplier' if derived else 'max_train_steps'}"
            searched = [f for f in (w_field, d_field) if f.startswith("search.")]
            if w >= steps:
                yield (
                    w_field if w_field in searched else here,
                    f"the longest warmup ({w}) must be < max_train_steps of round {r.name} ({steps})",
                )
            elif linear and d and w + d > steps:
                yield (
                    (searched or [here])[0],
                    f"warmup + decay_steps (up to {w} + {d}) must be <= max_train_steps of round "
                    f"{r.name} ({steps})",
                )
            elif linear and r.kind == "extend" and not d and steps < self.round_steps(self.source_round(r)):
                yield (
                    here,
                    (
                        f"round {r.name} ({steps} steps) is shorter than the round it extends "
                        f"({self.round_steps(self.source_round(r))}), whose linear decay it must keep"
                    ),
                )

    def _longest(self, name: str) -> tuple[str, int]:
        """The largest value of a schedule field any trial can get, and the field that sets it."""
        hp = self.search.get(name)
        if hp is None:
            return f"training.schedule.{name}", getattr(self.training.schedule, name) or 0
        return f"search.{name}", max(int(v) for v in hp.extremes)

    def round_steps(self, rnd: Round) -> int:
        """max_train_steps of a round: its override, else (extend) the source round's times
        step_multiplier, else training.max_train_steps."""
        if rnd.max_train_steps:
            return rnd.max_train_steps
        if rnd.kind == "extend":
            return max(1, round(self.round_steps(self.source_round(rnd)) * rnd.multiplier))
        if rnd.kind == "repeat":
            return self.round_steps(self.source_round(rnd))
        return self.training.max_train_steps

    def source_round(self, rnd: Round) -> Round:
        i = self.rounds.index(rnd)
        name = rnd.from_round or self.rounds[i - 1].name
        return next(r for r in self.rounds if r.name == name)

    @property
    def searched_hparams(self) -> dict[str, HParam]:
        return {k: v for k, v in self.search.items() if v.searched}

    @property
    def fixed_hparams(self) -> dict[str, Scalar]:
        return {k: v.value for k, v in self.search.items() if not v.searched}

    @property
    def layout(self) -> StudyLayout:
        """Where this study's files are on storage."""
        return StudyLayout.of(self.storage, self.name)

    @property
    def study_uri(self) -> str:
        return self.layout.uri


def _schedule_value_errors(name: str, hp: HParam):
    """warmup_steps and decay_steps are step counts (ints, decay > 0); final_lr_fraction is a
    number in [0, 1]."""
    if name in ("warmup_steps", "decay_steps"):
        if hp.searched and hp.type == "float":
            yield "a step count: must be type int or a choice of integers (type is float)"
            return
        values = hp.extremes
        if any(isinstance(v, bool) or not isinstance(v, int | float) or v != int(v) for v in values):
            yield f"a step count: every value must be an integer (got {', '.join(map(str, values))})"
            return
        low = 1 if name == "decay_steps" else 0
        if min(values) < low:
            yield f"must be >= {low} (got {min(values)})"
        return
    values = hp.extremes
    if any(isinstance(v, bool) or not isinstance(v, int | float) for v in values):
        yield f"must be a number (got {', '.join(map(str, values))})"
    elif not all(0 <= v <= 1 for v in values):
        yield f"a fraction of the base learning rate: must be in [0, 1] (got {', '.join(map(str, values))})"


def _clip_value_errors(hp: HParam):
    """grad_clip_norm is a gradient norm: a number > 0."""
    values = hp.extremes
    if any(isinstance(v, bool) or not isinstance(v, int | float) for v in values):
        yield f"a gradient norm: must be a number (got {', '.join(map(str, values))})"
    elif min(values) <= 0:
        yield f"a gradient norm: must be > 0 (got {min(values)})"


def ghost_batch_fits(batch_size: int, world_size: int, virtual_batch_size: int) -> bool:
    """Ghost batch norm's rule: statistics over exactly `virtual_batch_size` examples. Each
    worker's batch is a whole number of virtual batches, or the batches of a group of
    consecutive workers make one (a group size that divides the number of workers)."""
    per, v = batch_size // world_size, virtual_batch_size
    if batch_size % world_size:
        return False
    if per >= v:
        return per % v == 0
    return v % per == 0 and world_size % (v // per) == 0


def _microbatch_errors(training: Training, world: int):
    """training.microbatch_size must split each worker's batch (and, with ghost batch norm, be
    split into virtual batches itself)."""
    micro, per = training.microbatch_size, training.batch_size // world
    if micro is None or micro <= 0 or training.batch_size % world:
        return
    if per % micro:
        yield (
            "training.microbatch_size",
            f"must divide the per-worker batch {per} (batch_size {training.batch_size} over {world} "
            f"workers; {per} % {micro} != 0)",
        )
    elif training.ghost_batch_norm and micro % training.virtual_batch_size:
        yield (
            "training.microbatch_size",
            f"must be a multiple of virtual_batch_size {training.virtual_batch_size} with ghost_batch_norm",
        )


def _ghost_batch_errors(training: Training, world: int):
    batch_size, v = training.batch_size, training.virtual_batch_size
    if batch_size % world or ghost_batch_fits(batch_size, world, v):
        return
    per = batch_size // world
    if per > v:
        why = f"does not divide the per-worker batch of {per}"
    elif v % per:
        why = f"is not a whole number of per-worker batches of {per}"
    else:
        why = f"needs groups of {v // per} workers' batches of {per}, and {world} workers do not split so"
    sizes = [x for x in range(1, batch_size + 1) if ghost_batch_fits(batch_size, world, x)]
    batches = range(world, 2 * max(batch_size, v * world) + 1, world)
    yield (
        "training.virtual_batch_size",
        f"{v} {why} (training.batch_size {batch_size} over {world} workers); nearest that work: "
        f"virtual_batch_size {_nearest(sizes, v)}, or batch_size "
        f"{_nearest([b for b in batches if ghost_batch_fits(b, world, v)], batch_size)}",
    )


def _nearest(values: list[int], x: int) -> str:
    """The largest of `values` below x and the smallest above it."""
    return " or ".join(str(n) for n in [n for n in values if n < x][-1:] + [n for n in values if n > x][:1])


# ----------------------------------------------------------------------------- loading


def load_file(path: str | os.PathLike) -> Study:
    """Read and validate a study file. Raises SpecError naming the file or the field."""
    try:
        if "://" in str(path):  # a stored study file (gs://..., the reproduction command's)
            text = storage.read_bytes(str(path)).decode("utf-8")
        else:
            with open(path, encoding="utf-8") as f:
                text = f.read()
    except OSError as e:
        raise SpecError(f"{path}: cannot read study file ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise SpecError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    return load_text(text, source=str(path))


def load_text(text: str, source: str = "<study>") -> Study:
    return load_dict(load_yaml(text, source))


def load_dict(raw: dict) -> Study:
    return build(Study, _without_old_round_defaults(raw), "")


def _without_old_round_defaults(raw):
    """A study file stored by an earlier version lists every field of every round, with
    `from_round: null` and `step_multiplier: 2.0` where that was the default of a field the
    round does not read; it is dropped here, so a stored study still loads (a study file
    written by hand, without `from_round: null`, is checked as written)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("rounds"), list):
        return raw
    rounds = []
    for r in raw["rounds"]:
        if isinstance(r, dict) and "from_round" in r and r["from_round"] is None:
            unread = r.get("kind", "quasi_random") != "extend" or r.get("max_train_steps") is not None
            if unread and r.get("step_multiplier") == DEFAULT_STEP_MULTIPLIER:
                r = {k: v for k, v in r.items() if k != "step_multiplier"}
        rounds.append(r)
    return {**raw, "rounds": rounds}


def schedule_from_dict(raw: dict) -> Schedule:
    return build(Schedule, raw, "schedule")


def to_dict(study: Study) -> dict:
    """Plain data (lists, dicts, scalars) that `load_dict` turns back into an equal Study."""

    def plain(v):
        if isinstance(v, tuple | list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(dataclasses.asdict(study))


def dump_yaml(study: Study) -> str:
    return yaml.safe_dump(to_dict(study), sort_keys=False)


def with_overrides(study: Study, **changes) -> Study:
    return dataclasses.replace(study, **changes)
