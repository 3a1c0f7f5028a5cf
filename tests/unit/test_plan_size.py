"""What a study runs, counted before it starts: `playbook validate`'s trials and steps and the
budget check (`budget.max_total_steps`) count a repeat round once per scientific value it
repeats, for every kind of source round, against numbers worked out by hand."""

from __future__ import annotations

import copy

import yaml

from service import cli
from service.planning.rounds import plan_round
from service.study import spec
from tests.helpers.studies import MINIMAL_STUDY


def study_dict(search: dict, rounds: list[dict], max_total_steps: int | None = None) -> dict:
    d = copy.deepcopy(MINIMAL_STUDY)  # max_train_steps 100
    d["search"], d["rounds"] = search, rounds
    if max_total_steps is not None:
        d["budget"] = {"compute_bound": True, "max_total_steps": max_total_steps, "first_round_share": 1.0}
    return d


# width (scientific) x learning rate: a grid of 3 x 2 trials with 3 widths among them
GRID_SEARCH = {
    "learning_rate": {"role": "nuisance", "type": "choice", "values": [0.1, 0.3]},
    "width": {"role": "scientific", "type": "choice", "values": [8, 16, 32]},
}
GRID_ROUNDS = [
    {"name": "grid", "kind": "grid", "num_trials": 6},  # 6 trials x 100 steps = 600
    {"name": "rep", "kind": "repeat", "num_trials": 2},  # 3 widths x 2 = 6 trials x 100 = 600
    {"name": "longer", "kind": "extend", "num_trials": 1, "from_round": "grid"},  # 1 x 200 = 200
    {"name": "rep2", "kind": "repeat", "num_trials": 3},  # one configuration: 3 trials x 200 = 600
    {"name": "rep3", "kind": "repeat", "num_trials": 1, "from_round": "rep"},  # 3 widths: 3 x 100 = 300
]
GRID_TRIALS, GRID_STEPS = 6 + 6 + 1 + 3 + 3, 600 + 600 + 200 + 600 + 300

# width (scientific, 2 values) with a searched learning rate: quasi-random, then bayesian
QUASI_SEARCH = {
    "learning_rate": {"role": "nuisance", "min": 0.01, "max": 1.0, "scale": "log"},
    "width": {"role": "scientific", "type": "choice", "values": [8, 16]},
}
QUASI_ROUNDS = [
    {"name": "explore", "num_trials": 8},  # 8 x 100 = 800, both widths among them
    {"name": "rep", "kind": "repeat", "num_trials": 2},  # 2 widths x 2 = 4 trials x 100 = 400
    {"name": "bo", "kind": "bayesian", "num_trials": 3, "from_round": "explore"},  # 3 x 100 = 300
    {"name": "bo_rep", "kind": "repeat", "num_trials": 2},  # at most 2 widths in 3 trials: 4 x 100 = 400
]
QUASI_TRIALS, QUASI_STEPS = 8 + 4 + 3 + 4, 800 + 400 + 300 + 400


def validate(tmp_path, capsys, d: dict) -> tuple[int, str, str]:
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(d))
    code = cli.main(["validate", str(path)])
    out, err = capsys.readouterr()
    return code, out, err


def test_validate_counts_a_repeat_round_per_scientific_value(tmp_path, capsys):
    code, out, _ = validate(tmp_path, capsys, study_dict(GRID_SEARCH, GRID_ROUNDS))
    assert code == 0
    assert out.startswith(f"ok: study tiny: 5 round(s), {GRID_TRIALS} trials, {GRID_STEPS} training steps")
    code, out, _ = validate(tmp_path, capsys, study_dict(QUASI_SEARCH, QUASI_ROUNDS))
    assert code == 0
    assert out.startswith(f"ok: study tiny: 4 round(s), {QUASI_TRIALS} trials, {QUASI_STEPS} training steps")
    # the hand count's premise: the planner puts both widths among the 8 quasi-random trials
    study = spec.load_dict(study_dict(QUASI_SEARCH, QUASI_ROUNDS))
    assert {c["hparams"]["width"] for c in plan_round(study, study.rounds[0], [])} == {8, 16}


def test_the_budget_counts_what_the_repeat_rounds_run(tmp_path, capsys):
    studies = ((GRID_SEARCH, GRID_ROUNDS, GRID_STEPS), (QUASI_SEARCH, QUASI_ROUNDS, QUASI_STEPS))
    for search, rounds, steps in studies:
        code, out, _ = validate(tmp_path, capsys, study_dict(search, rounds, max_total_steps=steps))
        assert code == 0 and out.startswith("ok: study tiny")
        code, out, err = validate(tmp_path, capsys, study_dict(search, rounds, max_total_steps=steps - 1))
        assert code == 2 and out == ""
        assert err.startswith(
            f"playbook: error: budget.max_total_steps: the rounds plan {steps} training steps"
        ) and err.endswith(f"more than the budget of {steps - 1}\n")
        assert err.count("\n") == 1


def test_a_repeat_round_without_scientific_hyperparameters_repeats_one_trial(tmp_path, capsys):
    search = {"learning_rate": {"role": "nuisance", "min": 0.01, "max": 1.0, "scale": "log"}}
    rounds = [{"name": "explore", "num_trials": 4}, {"name": "rep", "kind": "repeat", "num_trials": 3}]
    code, out, _ = validate(tmp_path, capsys, study_dict(search, rounds))
    assert code == 0 and out.startswith("ok: study tiny: 2 round(s), 7 trials, 700 training steps")


def test_a_round_planned_from_rows_is_bounded_by_its_trials_and_scientific_values(tmp_path, capsys):
    """A round whose own search takes a value from an earlier round's best (`best_of`) is planned
    from trial rows: before anything runs its scientific values are at most one per trial and
    no more than the space holds (min(4, 2 widths) = 2), and validate does not plan it."""
    search = {
        **QUASI_SEARCH,
        "momentum": {"role": "nuisance", "min": 0.5, "max": 0.99},
    }
    rounds = [
        {"name": "explore", "num_trials": 8},  # 800
        {"name": "again", "num_trials": 4, "search": {"momentum": {"role": "fixed", "best_of": "explore"}}},
        {"name": "rep", "kind": "repeat", "num_trials": 2},  # 2 widths x 2 = 4 trials x 100 = 400
    ]
    code, out, err = validate(tmp_path, capsys, study_dict(search, rounds))
    assert code == 0, err
    assert out.startswith("ok: study tiny: 3 round(s), 16 trials, 1600 training steps")
