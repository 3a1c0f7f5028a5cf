"""Planning a `kind: bayesian` round (exploitation after exploration), no Ray here.

An optuna study with a TPE sampler seeded by the round's `seed`, warm-started with the trials of
the source round that are over: a finished trial with its best metric, a diverged one as an
infeasible trial (optuna's constraint `diverged` = 1: TPE ranks it below every feasible trial,
with the worst value the trial reported, so its region counts as bad, never as a good one with a
bad number). The source round is the sampler's start-up phase: TPE models its results from the
round's first suggestion (`n_startup_trials=0`). With `narrow_to_best: k` the searched space is
narrowed to what the best k finished source trials span (`narrowed_space`) and only the source
trials inside that region warm-start the sampler. `SuggestTrial` turns each suggestion into a
trial config like `rounds.plan_round`'s.
"""

from __future__ import annotations

import dataclasses

import optuna

from service.core import ranking
from service.core.errors import StudyStopped
from service.core.trial_status import TrialStatus
from service.planning import rounds, schedules
from service.study.search import HParam, Round
from service.study.spec import Study

DIVERGED = "diverged"
"""The constraint a diverged trial violates (its value 1; 0 for every other trial)."""


def distribution(hp: HParam) -> optuna.distributions.BaseDistribution:
    """The optuna distribution of one searched dimension (log-uniform where scale is log)."""
    if hp.type == "choice":
        return optuna.distributions.CategoricalDistribution(hp.values)
    log = hp.scale == "log"
    if hp.type == "int":
        return optuna.distributions.IntDistribution(int(hp.min), int(hp.max), log=log)
    return optuna.distributions.FloatDistribution(float(hp.min), float(hp.max), log=log)


def narrowed_space(space: dict[str, HParam], best_rows: list[dict]) -> dict[str, HParam]:
    """Each searched dimension narrowed to the values the rows took: a range to [min, max] of
    them (the same bounds in log space: the logarithm keeps their order), a choice to the
    values among them (in the study file's order). Fixed dimensions unchanged."""
    out = {}
    for name, hp in space.items():
        taken = [r[f"hp/{name}"] for r in best_rows]
        if not hp.searched or not taken:
            out[name] = hp
        elif hp.type == "choice":
            out[name] = dataclasses.replace(hp, values=tuple(v for v in hp.values if v in taken))
        else:
            out[name] = dataclasses.replace(hp, min=min(taken), max=max(taken))
    return out


def round_space(study: Study, rnd: Round, rows: list[dict]) -> dict[str, HParam]:
    """The space a bayesian round searches: its own (`rounds.resolved_space`), or that narrowed
    to the best `rnd.narrow_to_best` finished trials of its source round."""
    space = rounds.resolved_space(study, rnd, rows)
    if not rnd.narrow_to_best:
        return space
    source = study.source_round(rnd).name
    best = ranking.ranked_results([r for r in rows if r.get("round") == source], study.training.mode)
    if not best:
        raise StudyStopped(f"round {rnd.name}: round {source} has no finished trial to narrow the space to")
    return narrowed_space(space, best[: rnd.narrow_to_best])


def warm_start_trials(
    space: dict[str, HParam], rows: list[dict], round_names: tuple[str, ...], mode: str
) -> list[optuna.trial.FrozenTrial]:
    """The trials of `round_names` that are over, as optuna trials in `space`: finished ones with
    their best metric (feasible), diverged ones infeasible; trials with a value outside `space`
    (a narrowed one) are left out, as are failed and unfinished ones."""
    dists = {k: distribution(hp) for k, hp in space.items() if hp.searched}
    done = [r for r in rows if r.get("round") in round_names]
    out = []
    for row in sorted(done, key=lambda r: r["trial_name"]):
        params = {k: row.get(f"hp/{k}") for k in dists}
        if not all(_inside(v, space[k]) for k, v in params.items()):
            continue
        trial = _warm_trial(row, params, dists, mode)
        if trial is not None:
            out.append(trial)
    return out


def _inside(value, hp: HParam) -> bool:
    if value is None:
        return False
    if hp.type == "choice":
        return value in hp.values
    return hp.min <= value <= hp.max


def _warm_trial(row: dict, params: dict, dists: dict, mode: str) -> optuna.trial.FrozenTrial | None:
    if row.get("status") == TrialStatus.DIVERGED:
        value, violation = ranking.worst(mode), 1.0
    elif row.get("status") == TrialStatus.FINISHED and ranking.is_finite(row.get("best_metric")):
        value, violation = float(row["best_metric"]), 0.0
    else:
        return None
    return optuna.trial.create_trial(
        value=value, params=params, distributions=dists, constraints={DIVERGED: violation}
    )


def sampler(rnd: Round) -> optuna.samplers.TPESampler:
    """TPE seeded by the round's seed; the warm-start trials are its start-up phase."""
    return optuna.samplers.TPESampler(seed=rnd.seed, n_startup_trials=0)


def optuna_study(study: Study, rnd: Round, rows: list[dict], storage) -> optuna.Study:
    """The round's optuna study (named after the round) in `storage`, holding its warm start:
    the source round's trials and this round's own that are over (a resumed round)."""
    space = round_space(study, rnd, rows)
    direction = "minimize" if study.training.mode == "min" else "maximize"
    ot = optuna.create_study(storage=storage, sampler=sampler(rnd), study_name=rnd.name, direction=direction)
    names = (study.source_round(rnd).name, rnd.name)
    ot.add_trials(warm_start_trials(space, rows, names, study.training.mode))
    return ot


class SuggestTrial:
    """Optuna's define-by-run function for the round: suggests every searched dimension of
    `space` and returns the trial config (`{"trial": config}`) of the round's next trial, indexed
    from `first_index` on in the order optuna numbers its trials after the `num_warm` ones."""

    def __init__(self, study: Study, rnd: Round, space: dict[str, HParam], num_warm: int, first_index: int):
        self.study, self.rnd, self.space = study, rnd, space
        self.num_warm, self.first_index = num_warm, first_index

    def __call__(self, trial) -> dict:
        hparams = {k: suggest(trial, k, hp) for k, hp in self.space.items() if hp.searched}
        hparams.update({k: hp.value for k, hp in self.space.items() if not hp.searched})
        index = self.first_index + trial.number - self.num_warm
        schedule = schedules.for_trial(self.study.training.schedule, hparams)
        steps, seed = self.study.round_steps(self.rnd), self.study.training.seed
        return {"trial": rounds.trial_config(self.rnd, index, hparams, steps, seed, schedule)}


def suggest(trial, name: str, hp: HParam):
    """One dimension's value from optuna's trial (the distribution `distribution` gives)."""
    if hp.type == "choice":
        return trial.suggest_categorical(name, hp.values)
    if hp.type == "int":
        return trial.suggest_int(name, int(hp.min), int(hp.max), log=hp.scale == "log")
    return trial.suggest_float(name, float(hp.min), float(hp.max), log=hp.scale == "log")


def remaining(rnd: Round, rows: list[dict]) -> tuple[int, int]:
    """(trials still to run, the index of the first): a resumed round keeps its trials that are
    over and plans the rest afresh, indexed after every trial of the round in the table."""
    mine = [r for r in rows if r.get("round") == rnd.name]
    done = sum(r.get("status") in (TrialStatus.FINISHED, TrialStatus.DIVERGED) for r in mine)
    indices = [int(r["trial_name"].rsplit("-", 1)[1]) for r in mine]
    return max(0, rnd.num_trials - done), max(indices, default=-1) + 1
