"""A `kind: bayesian` round's planning (service.planning.bayesian) on hand-made round-1 rows:
the narrowed space against bounds worked out by hand, the warm start (diverged trials
infeasible, trials outside a narrowed space left out), TPE's first suggestion conditioned on
them and reproducible, and the study file's checks."""

from __future__ import annotations

import copy
import math

import optuna
import pytest

from service.core.errors import SpecError
from service.core.trial_status import TrialStatus
from service.planning import bayesian
from service.study import spec
from tests.helpers.bayesian_round import ROWS, study
from tests.helpers.studies import MINIMAL_STUDY

optuna.logging.set_verbosity(optuna.logging.WARNING)


def test_narrowed_space_is_the_range_of_the_best_k_by_hand():
    s = study(narrow_to_best=3)
    space = bayesian.round_space(s, s.rounds[1], ROWS)
    # Best three finished (metric 0.20, 0.25, 0.30): trials 1, 2, 0.
    assert (space["learning_rate"].min, space["learning_rate"].max) == (0.002, 0.010)
    assert space["learning_rate"].scale == "log"
    assert (space["depth"].min, space["depth"].max) == (2, 5)
    assert space["act"].values == ("relu", "tanh")
    assert space["width"].value == 4
    # The whole space without narrow_to_best.
    assert bayesian.round_space(study(), study().rounds[1], ROWS) == study().search


def test_warm_start_marks_diverged_trials_infeasible_and_drops_failed_ones():
    s = study()
    trials = bayesian.warm_start_trials(s.search, ROWS, ("r1", "r2"), "min")
    by_lr = {t.params["learning_rate"]: t for t in trials}
    assert sorted(by_lr) == [0.002, 0.004, 0.010, 0.050, 0.600, 0.900]  # not the failed 0.3
    for lr in (0.600, 0.900):
        assert by_lr[lr].constraints == {bayesian.DIVERGED: 1.0}
        assert by_lr[lr].value == math.inf
    for lr, metric in ((0.002, 0.30), (0.010, 0.20), (0.004, 0.25), (0.050, 0.40)):
        assert by_lr[lr].constraints == {bayesian.DIVERGED: 0.0} and by_lr[lr].value == metric
    assert by_lr[0.010].params == {"learning_rate": 0.010, "depth": 5, "act": "tanh"}


def test_a_narrowed_space_warm_starts_with_the_trials_inside_it_only():
    s = study(narrow_to_best=3)
    space = bayesian.round_space(s, s.rounds[1], ROWS)
    trials = bayesian.warm_start_trials(space, ROWS, ("r1",), "min")
    assert sorted(t.params["learning_rate"] for t in trials) == [0.002, 0.004, 0.010]


def first_suggestion(s: spec.Study, rows: list[dict]) -> dict:
    ot = bayesian.optuna_study(s, s.rounds[1], rows, optuna.storages.InMemoryStorage())
    space = bayesian.round_space(s, s.rounds[1], rows)
    suggest = bayesian.SuggestTrial(s, s.rounds[1], space, len(ot.trials), 0)
    return suggest(ot.ask())["trial"]


def test_first_suggestion_is_conditioned_on_round_one_and_reproducible():
    s = study(seed=7)
    config = first_suggestion(s, ROWS)
    assert config["trial_name"] == "r2-0000" and config["round"] == "r2"
    assert config["hparams"]["width"] == 4
    assert first_suggestion(s, ROWS) == config  # the same seed, the same history
    assert first_suggestion(s, []) != config  # the same sampler without the history
    # Not in the diverged region (learning rates >= 0.6 of the warm start): TPE's 'good' group
    # holds only the best finished trials.
    assert config["hparams"]["learning_rate"] < 0.6


def test_a_diverged_region_is_sampled_less_than_chance():
    """First suggestions of 20 seeds in the diverged region (learning rate >= 0.3): with the
    diverged trials infeasible, fewer than uniform sampling puts there (its log-space share of
    [0.001, 1]); with them left out of the warm start (as failed ones), more."""

    def in_diverged_region(rows):
        return sum(
            first_suggestion(study(seed=k), rows)["hparams"]["learning_rate"] >= 0.3 for k in range(20)
        )

    chance = 20 * math.log(1 / 0.3) / math.log(1 / 0.001)  # 3.5 of 20
    assert in_diverged_region(ROWS) < chance / 2
    assert in_diverged_region([r for r in ROWS if r["status"] != TrialStatus.DIVERGED]) > chance


@pytest.mark.parametrize(
    "change,field,why",
    [
        ({"from_round": "r9"}, "rounds[1].from_round", "no earlier round named 'r9'"),
        ({"from_round": "r2"}, "rounds[1].from_round", "no earlier round named 'r2'"),
        ({"num_trials": 0}, "rounds[1].num_trials", "must be > 0"),
        ({"narrow_to_best": 1}, "rounds[1].narrow_to_best", "must be 0 (whole space) or >= 2"),
        ({"max_concurrent_trials": 2}, "rounds[1].max_concurrent_trials", "one trial at a time"),
    ],
)
def test_bad_bayesian_round_names_the_field(change, field, why):
    with pytest.raises(SpecError) as e:
        study(**change)
    assert str(e.value).startswith(f"{field}: ") and why in str(e.value) and "\n" not in str(e.value)


def test_a_first_round_cannot_be_bayesian():
    raw = copy.deepcopy(MINIMAL_STUDY)
    raw["rounds"] = [{"name": "r1", "kind": "bayesian", "num_trials": 2}]
    with pytest.raises(SpecError, match=r"^rounds\[0\]\.kind: the first round cannot be bayesian"):
        spec.load_dict(raw)


def test_narrow_to_best_only_applies_to_bayesian():
    raw = copy.deepcopy(MINIMAL_STUDY)
    raw["rounds"][0]["narrow_to_best"] = 3
    with pytest.raises(SpecError, match=r"^rounds\[0\]\.narrow_to_best: only applies to kind: bayesian"):
        spec.load_dict(raw)


def test_a_resumed_round_runs_what_it_lacks_after_its_highest_index():
    s = study()
    mine = [
        {"trial_name": "r2-0000", "round": "r2", "status": TrialStatus.FINISHED},
        {"trial_name": "r2-0001", "round": "r2", "status": TrialStatus.FAILED},
    ]
    assert bayesian.remaining(s.rounds[1], ROWS + mine) == (2, 2)
    assert bayesian.remaining(s.rounds[1], ROWS) == (3, 0)


def test_plan_round_leaves_a_bayesian_round_to_its_searcher():
    from service.core.errors import PlaybookError
    from service.planning.rounds import plan_round

    s = study()
    with pytest.raises(
        PlaybookError, match="^round r2: a bayesian round's trials are planned by its searcher$"
    ):
        plan_round(s, s.rounds[1], ROWS)
