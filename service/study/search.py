"""The study file's sections that say which trials a study runs: `search:` (each
hyperparameter's role and range, `HParam`, and which hyperparameters the trainer reads) and
`rounds:` (`Round`). Each field's default and docstring live here; `service.study.spec`
assembles them into the Study."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from service.study.strict import Scalar
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
    best_of: str | None = None
    """In a round's `search:` only, instead of `value`: fixed to the value the best finished
    trial of this earlier round (of this study) took."""

    def errors(self):
        if self.best_of is not None and self.role != "fixed":
            yield "best_of", f"only for role fixed (role is {self.role})"
        if self.role == "fixed":
            if (self.value is None) == (self.best_of is None):
                yield "value", "required when role is fixed (or, in a round's search, best_of; not both)"
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
    warm-start the sampler; repeat: the round whose best trials are repeated (default: the
    previous round). `other-study/round` names a round of another study under the same storage
    root, whose trials this round builds on."""
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
    search: dict[str, HParam] = field(default_factory=dict)
    """This round's own search-space entries, each replacing the study's entry of that name (or
    adding one) for this round only: a range widened or narrowed, a hyperparameter fixed (to a
    value, or `best_of` an earlier round), a role changed. An extend or repeat round reruns
    configurations: its entries may only fix hyperparameters."""
    reason: str = ""
    """Why the round is there, shown by `playbook status` and the report beside what it changed:
    `playbook next` writes the verdicts that called for it. Free text, read by nothing that
    plans or runs trials (a rerun may change it)."""

    @property
    def from_other_study(self) -> bool:
        """`from_round` names another study's round (`other-study/round`)."""
        return self.from_round is not None and "/" in self.from_round

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
