"""A `kind: repeat` round: its plan (the best trial of each scientific value of the source
round, rerun with other seeds as long as it ran) and its verdict (Welch's t-test over the
repeats) on hand-made rows, against numbers worked out by hand and closed forms of Student's t."""

from __future__ import annotations

import copy
import math

import pytest

from service.analysis import seed_noise
from service.core.errors import SpecError
from service.planning.rounds import plan_round
from service.study import spec
from tests.helpers.studies import MINIMAL_STUDY


def study(**repeat) -> spec.Study:
    raw = copy.deepcopy(MINIMAL_STUDY)
    raw["search"] = {
        "learning_rate": {"role": "nuisance", "min": 0.001, "max": 1.0, "scale": "log"},
        "act": {"role": "scientific", "type": "choice", "values": ["relu", "tanh"]},
    }
    raw["rounds"] = [
        {"name": "r1", "num_trials": 4},
        {"name": "rep", "kind": "repeat", "num_trials": 3, **repeat},
    ]
    return spec.load_dict(raw)


def row(name: str, lr: float, act: str, metric: float, seed: int = 0, status: str = "FINISHED") -> dict:
    return {
        "trial_name": name,
        "round": name.split("-")[0],
        "status": status,
        "best_metric": metric,
        "seed": seed,
        "max_train_steps": 100,
        "hp/learning_rate": lr,
        "hp/act": act,
    }


R1 = [
    row("r1-0000", 0.01, "relu", 0.30),
    row("r1-0001", 0.10, "relu", 0.20),  # relu's best
    row("r1-0002", 0.05, "tanh", 0.25),  # tanh's best
    row("r1-0003", 0.50, "tanh", math.inf, status="DIVERGED"),
]


def test_repeats_the_best_trial_of_each_scientific_value_with_other_seeds():
    s = study()
    configs = plan_round(s, s.rounds[1], R1)
    got = [
        (c["trial_name"], c["repeat_of"], c["seed"], c["hparams"]["act"], c["hparams"]["learning_rate"])
        for c in configs
    ]
    assert got == [
        ("rep-0000", "r1-0001", 1, "relu", 0.10),
        ("rep-0001", "r1-0001", 2, "relu", 0.10),
        ("rep-0002", "r1-0001", 3, "relu", 0.10),
        ("rep-0003", "r1-0002", 1, "tanh", 0.05),
        ("rep-0004", "r1-0002", 2, "tanh", 0.05),
        ("rep-0005", "r1-0002", 3, "tanh", 0.05),
    ]
    assert all(c["max_train_steps"] == 100 for c in configs)


def test_welch_t_on_hand_worked_numbers():
    # means 2 and 5, variances 1 and 1: t = -3 / sqrt(1/3 + 1/3), df = (2/3)^2 / (2 * (1/3)^2 / 2) = 4
    t, df, p = seed_noise.welch([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
    assert t == pytest.approx(-3 / math.sqrt(2 / 3), rel=1e-12) and df == pytest.approx(4.0, rel=1e-12)
    # Student's t with 4 degrees of freedom: P(|T| >= t) = 1 - u (3 - u^2) / 2 with u = t / sqrt(t^2 + 4)
    u = abs(t) / math.sqrt(t * t + 4)
    assert p == pytest.approx(1 - u * (3 - u * u) / 2, abs=1e-9)


@pytest.mark.parametrize("t", [0.3, 1.5, 4.0])
def test_t_tail_against_closed_forms(t):
    assert seed_noise.t_two_sided_p(t, 1) == pytest.approx(1 - 2 / math.pi * math.atan(t), abs=1e-9)  # Cauchy
    assert seed_noise.t_two_sided_p(t, 2) == pytest.approx(1 - t / math.sqrt(2 + t * t), abs=1e-9)


def rep_rows(relu: list[float], tanh: list[float]) -> list[dict]:
    out = [row(f"rep-{i:04d}", 0.1, "relu", m, seed=i + 1) for i, m in enumerate(relu)]
    return out + [row(f"rep-{i + len(relu):04d}", 0.05, "tanh", m, seed=i + 1) for i, m in enumerate(tanh)]


def test_a_difference_beyond_seed_noise_is_called_so():
    s = study()
    sentence = seed_noise.repeat_sentence(
        rep_rows([0.20, 0.21, 0.19], [0.25, 0.26, 0.24]), s.search, "loss", "min"
    )
    assert sentence.startswith(
        "Seed repeats: act=relu: loss 0.2 ± 0.01 over 3 seeds; act=tanh: loss 0.25 ± 0.01"
    )
    assert "the difference exceeds seed noise (p < 0.05)" in sentence


def test_a_difference_within_seed_noise_is_called_so():
    s = study()
    sentence = seed_noise.repeat_sentence(
        rep_rows([0.20, 0.30, 0.10], [0.25, 0.15, 0.30]), s.search, "loss", "min"
    )
    assert "act=relu" in sentence.split(":")[1] and "is within seed noise (p >= 0.05)" in sentence


@pytest.mark.parametrize(
    "change,field,why",
    [
        ({"from_round": "nope"}, "rounds[1].from_round", "no earlier round named 'nope'"),
        ({"num_trials": 0}, "rounds[1].num_trials", "must be > 0"),
        ({"max_train_steps": 50}, "rounds[1].max_train_steps", "as long as the trials it repeats"),
    ],
)
def test_bad_repeat_round_names_the_field(change, field, why):
    with pytest.raises(SpecError) as e:
        study(**change)
    assert str(e.value).startswith(f"{field}: ") and why in str(e.value) and "\n" not in str(e.value)


def test_a_repeat_round_is_judged_like_an_extend_round():
    """Only where the best checkpoints sit: boundary and trial-count checks would judge a few
    repeated points (here the repeats sit at the learning rate's upper bound, a boundary
    verdict for an exploration round)."""
    from service.analysis.round_checks import BEST_STEP_KINDS, verdicts_for_round

    s = study()
    rows = [
        {**r, "hp/learning_rate": 1.0, "best_step": 100, "step": 100}
        for r in rep_rows([0.2, 0.21], [0.3, 0.31])
    ]
    kinds = {v.kind for v in verdicts_for_round(s, "rep", rows)}
    assert kinds <= set(BEST_STEP_KINDS)
    explore = {v.kind for v in verdicts_for_round(s, "r1", [{**r, "round": "r1"} for r in rows])}
    assert "boundary" in explore


def test_identical_results_on_every_seed_are_no_difference():
    """A rate metric at 0 on every seed of both values: no seed noise, no t statistic (0/0), and
    no difference -- not "exceeds seed noise" from p = max(0, nan)."""
    rows = rep_rows([0.0, 0.0, 0.0], [0.0, 0.0])
    sentence = seed_noise.repeat_sentence(rows, study().search, "error", "min")
    assert sentence.endswith("every seed of both gave error 0: no difference (no seed noise).")
    assert "nan" not in sentence and "exceeds" not in sentence


def test_different_results_without_seed_noise_are_a_difference_of_known_sign():
    # every tanh seed scores 0.25 and every relu seed 0.2: relu better (min) by exactly 0.05
    rows = rep_rows([0.2, 0.2], [0.25, 0.25, 0.25])
    sentence = seed_noise.repeat_sentence(rows, study().search, "loss", "min")
    assert sentence.endswith(
        "act=relu against act=tanh: every seed of each gave the same loss, act=relu better by exactly "
        "0.05: a difference (no seed noise to weigh it against)."
    )
    maximised = seed_noise.repeat_sentence(rep_rows([0.2, 0.2], [0.25, 0.25]), study().search, "acc", "max")
    assert "act=tanh against act=relu" in maximised and "act=tanh better by exactly 0.05" in maximised
    assert "nan" not in sentence + maximised
