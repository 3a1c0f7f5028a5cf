"""Study-file sections that belong to one practice each: the input pipeline (`input:`), the
max_train_steps finder (`find_steps:`), tracking (`tracking:`), the training budget
(`budget:`) and the training-curve thresholds (`curves:`). `service.study.spec` assembles
them into the Study; the strict loader treats them like every other section."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from service.study.strict import non_negative, positive


@dataclass(frozen=True)
class InputPipeline:
    """How each rank loads its training batches (see `service/data/loader.py`)."""

    prefetch_batches: int = 2
    """A background thread prepares the next shuffle window's batches once fewer than this
    many are ready for the step (0: no thread, the step waits for each window). Raise it when
    the input-bound verdict says prefetch is too shallow."""
    shuffle_window_row_groups: int = 4
    """Row groups whose rows are shuffled together (after shuffling the order of row groups
    every epoch), at least. Larger mixes better and holds more rows in memory per rank."""
    shuffle_window_mb: int = 64
    """A shuffle window also holds at least this many MB of the rank's rows (the columns read,
    uncompressed, as the parquet footers give them): with small row groups, a few of them
    shuffle few rows together, and the loader's per-window work recurs every few batches.
    0: windows of `shuffle_window_row_groups` alone."""
    cache_mb: int = 256
    """Per rank: when the rank's training shard fits in this many MB (its declared columns,
    uncompressed), its rows are kept in memory after the first epoch reads them, and later
    epochs read no file (tf.data's `cache()`). A larger shard is streamed every epoch. 0: never."""
    input_bound_threshold: float = 0.2
    """A trial is input-bound when its steps spend more than this fraction of their time
    waiting for the next batch (`input/exposed_fraction`, over all ranks)."""
    profile_steps: int = 0
    """Trace this many training steps (after the first) with the torch profiler on rank 0 and
    write `trials/<trial>/profile/rank0.trace.json` (open it in https://ui.perfetto.dev)."""

    workers: Literal["local", "processes", "ray_data"] = "local"
    """Who reads and preprocesses a rank's windows: `local` (its own prefetch thread),
    `processes` (a pool of local worker processes per rank, like DataLoader's `num_workers`:
    for online preprocessing in Python, which a thread cannot run beside the step) or
    `ray_data` (a pool of Ray Data actors per rank). All give the same shards, seeds and
    batches, bit for bit."""
    num_input_workers: int = 2
    """With `workers: processes` or `ray_data`: worker processes or Ray Data actors per
    training rank. Worker processes are not reserved with Ray: leave cores for them."""
    cpus_per_input_worker: float = 1.0
    """With `workers: ray_data`: CPUs reserved by each input actor (besides the trainers')."""
    sync_debug: bool = False
    """On CUDA: run each training step under `torch.cuda.set_sync_debug_mode("warn")`, so every
    device-to-host sync inside the step is named (a warning with its Python line) in the worker
    log. A diagnostic: it changes no result. Ignored on CPU."""

    def errors(self):
        yield from positive(self, "num_input_workers", "cpus_per_input_worker")
        yield from non_negative(self, "prefetch_batches", "profile_steps", "cache_mb", "shuffle_window_mb")
        yield from positive(self, "shuffle_window_row_groups")
        if not 0 < self.input_bound_threshold < 1:
            yield "input_bound_threshold", f"must be in (0, 1) (got {self.input_bound_threshold})"


@dataclass(frozen=True)
class FindSteps:
    learning_rates: tuple[float, ...]
    """The constant learning rates to try (a grid; the fastest must not be at either end)."""
    max_train_steps: int
    """Steps per sweep trial (N): a trial that has not fit the training set by then does not."""
    train_loss_threshold: float
    """The training set counts as fit once the loss of the fixed training sample, evaluated in
    eval mode like validation (`train_eval/loss`), is at or below this."""
    eval_every_steps: int = 10
    """How often the training sample is evaluated (the resolution of the answer)."""
    train_eval_sample_size: int = 2048
    """Training examples in that fixed sample (all of them if the split has fewer)."""

    def errors(self):
        if len(self.learning_rates) < 3:
            yield "learning_rates", "needs at least 3 values (the best must not be at an edge)"
        if any(lr <= 0 for lr in self.learning_rates):
            yield "learning_rates", "must all be > 0"
        if list(self.learning_rates) != sorted(set(self.learning_rates)):
            yield "learning_rates", "must be strictly increasing"
        yield from positive(self, "max_train_steps", "train_loss_threshold", "eval_every_steps")
        yield from positive(self, "train_eval_sample_size")


@dataclass(frozen=True)
class Tracking:
    mlflow_uri: str | None = None
    """Mirror every trial to MLflow at this tracking URI (e.g. `file:///shared/mlruns` or
    `http://mlflow:5000`): params, per-evaluation metrics, tags with the git commit. Off when
    unset; mlflow is imported only then (install it yourself: `pip install mlflow-skinny`)."""
    progress_interval_s: float = 10.0
    """At most one progress line per trial this often in the job log (plus its last one)."""

    def errors(self):
        yield from positive(self, "progress_interval_s")


@dataclass(frozen=True)
class Budget:
    """Is the study compute-bound, and if so, what it may spend (the playbook's chapter on how
    long to train: its advice differs between the two regimes)."""

    compute_bound: bool
    """true: the budget, not the data, sets how long trials train; rounds grow the length
    (round 1 short, round 2 longer) within `max_total_steps`. false: train as long as the
    training set needs (`playbook find-steps`) and keep that max_train_steps for every
    exploration round."""
    max_total_steps: int | None = None
    """compute-bound only (required there): training steps the whole study may spend, summed
    over every trial of every round (its trials x the round's max_train_steps, a repeat round's
    num_trials for each scientific value it repeats); a plan over it is refused."""
    first_round_share: float | None = None
    """compute-bound only: the fraction of `max_total_steps` round 1 may spend, leaving the rest
    for the longer rounds after it (default 0.5: the playbook gives no number; half is this
    service's choice). A plan over it is warned about at validate, and round 1's verdicts say
    when it spent more."""

    @property
    def round_one_share(self) -> float:
        return 0.5 if self.first_round_share is None else self.first_round_share

    def errors(self):
        if not self.compute_bound:
            for name in ("max_total_steps", "first_round_share"):
                if getattr(self, name) is not None:
                    yield name, "only applies with compute_bound: true"
            return
        if self.max_total_steps is None:
            yield "max_total_steps", "required with compute_bound: true"
        yield from positive(self, "max_total_steps")
        if self.first_round_share is not None and not 0 < self.first_round_share <= 1:
            yield "first_round_share", f"must be in (0, 1] (got {self.first_round_share})"

    def plan_errors(self, total: int):
        """The study's plan against the budget: the `total` training steps its rounds run
        (`service.planning.plan_size`) may not exceed it."""
        if not self.compute_bound or self.max_total_steps is None:
            return
        if total > self.max_total_steps:
            yield (
                "budget.max_total_steps",
                f"the rounds plan {total} training steps (trials x max_train_steps, summed; a repeat "
                f"round's num_trials per scientific value), more than the budget of {self.max_total_steps}",
            )


FRACTION_FIELDS = (
    "tail_fraction", "overfit_rise", "noise_ratio", "still_improving", "saturated_by",
    "saturation_tolerance", "loss_rise", "early_fraction",
)  # fmt: skip


@dataclass(frozen=True)
class Curves:
    """Thresholds of the training-curve verdicts (`service/analysis/curves.py`, each rule in
    docs/verdicts.md). A curve's *improvement* is its first evaluation's value minus its best
    one (the metric's mode says which is best); a fraction of improvement measures a change
    against it, so one threshold fits any metric's scale."""

    tail_fraction: float = 0.25
    """"Late in training" and "at the end": the evaluations after the first
    (1 - tail_fraction) x max_train_steps steps."""
    overfit_rise: float = 0.1
    """Overfitting: after its best evaluation the validation metric ends worse than that best by
    more than this fraction of its improvement, while the training loss still fell."""
    noise_ratio: float = 0.1
    """Late noise: the standard deviation of the step-to-step changes of a curve over the tail
    is more than this fraction of the curve's improvement."""
    still_improving: float = 0.05
    """Still improving: the tail improved the metric's best by more than this fraction of its
    whole improvement (train longer)."""
    saturated_by: float = 0.5
    """Saturated early: the metric and the training loss were both within
    `saturation_tolerance` of their best by this fraction of training (steps wasted)."""
    saturation_tolerance: float = 0.02
    """How close to its best (a fraction of its improvement) counts as saturated."""
    loss_rise: float = 0.1
    """Training loss rising: it ends above its lowest value by more than this fraction of its
    improvement."""
    early_fraction: float = 0.2
    """"Early in training" for instability: the first early_fraction x max_train_steps steps."""
    spike_ratio: float = 1.5
    """An early loss spike: an evaluation's training loss above spike_ratio times the lowest one
    before it (or a divergence in that window)."""

    def errors(self):
        for name in FRACTION_FIELDS:
            value = getattr(self, name)
            if not 0 < value < 1:
                yield name, f"must be in (0, 1) (got {value})"
        if not self.spike_ratio > 1:
            yield "spike_ratio", f"must be > 1 (got {self.spike_ratio})"
