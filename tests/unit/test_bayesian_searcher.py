"""The searcher Ray Tune runs for a `kind: bayesian` round (service.orchestration.bayesian_search,
Tune's OptunaSearch), asked and told as Tune does, without a cluster: its first suggestion
avoids a diverged round-1 region more than chance (test_bayesian_round's check of the planning,
here through the searcher itself), and a trial of the round that diverges is told to optuna as
infeasible, one that finishes as feasible."""

from __future__ import annotations

import math

import optuna
import pytest

from service.core.ranking import worst
from service.core.trial_status import TrialStatus
from service.orchestration.bayesian_search import round_searcher
from service.planning import bayesian
from tests.helpers.bayesian_round import ROWS, study

optuna.logging.set_verbosity(optuna.logging.WARNING)
METRIC = "validation/error"


def first_learning_rate(seed: int, rows: list[dict]) -> float:
    s = study(seed=seed)
    config = round_searcher(s, s.rounds[1], rows, 0).suggest("tune-trial-0")
    assert config["trial"]["trial_name"] == "r2-0000"
    return config["trial"]["hparams"]["learning_rate"]


def test_the_searchers_first_suggestion_avoids_the_diverged_region():
    """Learning rates >= 0.3 diverged in round 1 (0.6, 0.9): over 20 round seeds, fewer first
    suggestions land there than uniform sampling puts there (its log-space share of [0.001, 1],
    3.5 of 20); with the diverged trials left out of the table, more do."""
    chance = 20 * math.log(1 / 0.3) / math.log(1 / 0.001)
    kept = [r for r in ROWS if r["status"] != TrialStatus.DIVERGED]
    assert sum(first_learning_rate(k, ROWS) >= 0.3 for k in range(20)) < chance / 2
    assert sum(first_learning_rate(k, kept) >= 0.3 for k in range(20)) > chance


@pytest.mark.parametrize("status, violation", [(TrialStatus.DIVERGED, 1.0), (TrialStatus.FINISHED, 0.0)])
def test_a_trial_of_the_round_is_told_with_its_divergence_as_a_constraint(status, violation):
    s = study(seed=3)
    searcher = round_searcher(s, s.rounds[1], ROWS, 0)
    searcher.suggest("tune-trial-0")
    value = worst("min") if status == TrialStatus.DIVERGED else 0.1
    searcher.on_trial_complete("tune-trial-0", {"status": status.reported, METRIC: value})
    told = searcher._ot_study.trials[-1]  # the warm start's 6 trials, then this one
    assert len(searcher._ot_study.trials) == 7 and told.state == optuna.trial.TrialState.COMPLETE
    assert told.constraints == {bayesian.DIVERGED: violation}
    assert told.value == value and set(told.params) == {"learning_rate", "depth", "act"}
