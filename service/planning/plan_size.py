"""How many trials and training steps a study's rounds run, counted before it starts: what
`playbook validate` says and what the budget check (`budget.max_total_steps`) weighs.

Every round runs `num_trials` trials of its max_train_steps (`Study.round_steps`) but a repeat
round, which reruns the best trial of each scientific value of its source round `num_trials`
times: `num_trials` x the scientific values its source can end with. That is the number of
distinct scientific values among a quasi_random or grid round's planned trials (planned before
anything runs, so exactly), one for an extend round (one configuration), at most one per trial
and per point of the scientific space for a bayesian round, a round whose own `search:` takes a
value from another round's best (`best_of`) or another study's round, and its own source's for
a repeat round. It is the most the round runs: a value whose every trial diverged or failed is
not repeated."""

from __future__ import annotations

import math

from service.core.errors import SpecError
from service.planning.rounds import plan_round
from service.study.search import HParam, Round
from service.study.spec import Study


def round_trials(study: Study, rnd: Round) -> int:
    """The trials `rnd` runs (at most, for a repeat round)."""
    if rnd.kind != "repeat":
        return rnd.num_trials
    return rnd.num_trials * scientific_values(study, study.source_round(rnd))


def planned_trials(study: Study) -> int:
    return sum(round_trials(study, rnd) for rnd in study.rounds)


def planned_steps(study: Study) -> int:
    """Training steps over every trial of every round."""
    return sum(round_trials(study, rnd) * study.round_steps(rnd) for rnd in study.rounds)


def scientific_values(study: Study, rnd: Round) -> int:
    """How many combinations of the scientific hyperparameters' values `rnd`'s trials can have."""
    if rnd not in study.rounds:  # another study's round (`Study.linked`): only its kind is known
        return 1 if rnd.kind == "extend" else bound(study, rnd, study.search)
    space = study.value_bounds(rnd)
    names = [k for k, hp in space.items() if hp.role == "scientific"]
    if not names or rnd.kind == "extend":
        return 1
    if rnd.kind == "repeat":
        return scientific_values(study, study.source_round(rnd))
    if rnd.kind == "bayesian" or any(hp.best_of for hp in study.round_space(rnd).values()):
        return bound(study, rnd, space)  # planned from trial rows: not before anything runs
    return len({tuple(c["hparams"][k] for k in names) for c in plan_round(study, rnd, [])})


def bound(study: Study, rnd: Round, space: dict[str, HParam]) -> int:
    """At most one combination per trial, and no more than the scientific space holds."""
    names = [k for k, hp in space.items() if hp.role == "scientific"]
    return int(min(rnd.num_trials, math.prod(points(space[k]) for k in names)))


def points(hp: HParam) -> float:
    """The values a searched dimension can take (a float range: infinitely many)."""
    if hp.type == "choice":
        return len(hp.values)
    return int(hp.max) - int(hp.min) + 1 if hp.type == "int" else math.inf


def check_budget(study: Study) -> None:
    """A compute-bound study's plan over its budget: SpecError naming budget.max_total_steps."""
    for field, message in study.budget.plan_errors(planned_steps(study)) if study.budget else ():
        raise SpecError(f"{field}: {message}")
