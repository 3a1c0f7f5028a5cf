"""A `kind: bayesian` round's searcher: Ray Tune's `OptunaSearch` over the round's optuna
study (`service.planning.bayesian`: TPE seeded by the round, warm-started with its source
round), whose define-by-run function returns each trial's whole config.

Tune tells optuna a trial's final result only (the summary, the trial's best metric; the
intermediate evaluations are not reported, optuna prunes nothing): a diverged trial as an
infeasible one (constraint `diverged` = 1), a trial ended by a data error as FAIL (optuna's
samplers leave it out)."""

from __future__ import annotations

from optuna.storages import InMemoryStorage
from ray.tune.search.optuna import OptunaSearch

from service.core.trial_status import TrialStatus
from service.orchestration.ray_private import optuna_trial_of
from service.planning import bayesian
from service.study.search import Round
from service.study.spec import Study


class PlaybookOptunaSearch(OptunaSearch):
    def on_trial_result(self, trial_id: str, result: dict) -> None:
        """Intermediate results are not told (TPE reads final values; nothing is pruned)."""

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        status = (result or {}).get("status")
        if status == TrialStatus.FAILED.reported:
            result, error = None, True
        elif result:
            violation = float(status == TrialStatus.DIVERGED.reported)
            optuna_trial_of(self, trial_id).set_constraint(bayesian.DIVERGED, violation)
        super().on_trial_complete(trial_id, result, error)


def round_searcher(study: Study, rnd: Round, rows: list[dict], first_index: int) -> OptunaSearch:
    """The searcher of a bayesian round, its optuna study warm-started from `rows` (the trial
    table); the round's new trials are indexed from `first_index` on."""
    storage = InMemoryStorage()
    ot = bayesian.optuna_study(study, rnd, rows, storage)
    space = bayesian.round_space(study, rnd, rows)
    suggest = bayesian.SuggestTrial(study, rnd, space, len(ot.trials), first_index)
    return PlaybookOptunaSearch(
        space=suggest,
        metric=study.training.metric,
        mode=study.training.mode,
        sampler=ot.sampler,
        study_name=rnd.name,
        storage=storage,
    )
