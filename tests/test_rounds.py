"""Round planning and the round-2 schedule extension: linear keeps its decay length and
lengthens the constant phase, cosine keeps the base LR and stretches; checked step by step."""

from __future__ import annotations

import math

import numpy as np
import pytest

from service import spec
from service.errors import PlaybookError
from service.rounds import plan_round
from service.schedules import extend, lr_factor
from service.spec import Schedule


def linear_reference(step: int, total: int, warmup: int, decay: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    start = total - decay
    return 1.0 if step < start else 1.0 - (step - start) / decay


def test_linear_extension_keeps_decay_length_and_lengthens_constant_phase():
    old = Schedule(kind="linear", warmup_steps=10, decay_steps=None)
    new = extend(old, 100, 300)
    got = np.array([lr_factor(s, 300, new) for s in range(300)])
    want = np.array([linear_reference(s, 300, 10, 90) for s in range(300)])  # decay was 100 - 10
    np.testing.assert_allclose(got, want, rtol=1e-12)
    # 200 constant steps, and the decay phase starts at the base LR: 201 steps at factor 1.
    assert int(np.sum(got[10:] == 1.0)) == 300 - 10 - 90 + 1
    # The decay phase itself is the same curve, step for step, as at the end of the old run.
    old_tail = [lr_factor(s, 100, old) for s in range(10, 100)]
    np.testing.assert_allclose(got[-90:], old_tail, rtol=1e-12)


def test_cosine_extension_keeps_base_lr_and_stretches():
    old = Schedule(kind="cosine", warmup_steps=5, final_lr_fraction=0.1)
    new = extend(old, 100, 250)
    got = np.array([lr_factor(s, 250, new) for s in range(250)])
    for s in range(5, 250):
        p = (s - 5) / 245
        assert got[s] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)), abs=1e-12)
    assert got[5] == 1.0  # the base LR is kept
    assert lr_factor(250, 250, new) == pytest.approx(0.1)


def study(**round2) -> spec.Study:
    return spec.load_dict(
        {
            "name": "r",
            "workload": "digits",
            "data": {"train": "a", "validation": "b"},
            "training": {
                "max_train_steps": 100,
                "batch_size": 8,
                "eval_every_steps": 50,
                "seed": 7,
                "schedule": {"kind": "linear", "warmup_steps": 10, "decay_steps": 30},
            },
            "search": {
                "learning_rate": {"role": "nuisance", "min": 0.01, "max": 1.0, "scale": "log"},
                "width": {"role": "fixed", "value": 4},
            },
            "rounds": [
                {"name": "explore", "num_trials": 3},
                {"name": "exploit", "kind": "extend", "num_trials": 2, **round2},
            ],
        }
    )


ROWS = [
    {
        "trial_name": "explore-0000",
        "round": "explore",
        "status": "FINISHED",
        "best_metric": 0.30,
        "hp/learning_rate": 0.1,
        "hp/width": 4,
    },
    {
        "trial_name": "explore-0001",
        "round": "explore",
        "status": "FINISHED",
        "best_metric": 0.10,
        "hp/learning_rate": 0.2,
        "hp/width": 4,
    },
    {
        "trial_name": "explore-0002",
        "round": "explore",
        "status": "DIVERGED",
        "best_metric": None,
        "hp/learning_rate": 0.9,
        "hp/width": 4,
    },
]


def test_extend_round_reruns_the_best_config_longer_with_several_seeds():
    s = study(step_multiplier=3)
    configs = plan_round(s, s.rounds[1], ROWS)
    assert [c["trial_name"] for c in configs] == ["exploit-0000", "exploit-0001"]
    for i, c in enumerate(configs):
        assert c["hparams"] == {"learning_rate": 0.2, "width": 4}  # explore-0001, the best
        assert c["max_train_steps"] == 300
        assert c["seed"] == 7 + i
        assert c["extended_from"] == "explore-0001"
        assert spec.schedule_from_dict(c["schedule"]).decay_steps == 30
        assert "extended to 300 steps" in c["schedule_origin"]


def test_extend_with_mode_max_and_no_finished_source():
    s = study(max_train_steps=500)
    assert plan_round(s, s.rounds[1], ROWS)[0]["max_train_steps"] == 500
    with pytest.raises(PlaybookError, match="round exploit: round explore has no finished trial"):
        plan_round(s, s.rounds[1], [r for r in ROWS if r["status"] != "FINISHED"])


def test_extend_round_rules_in_the_spec():
    with pytest.raises(spec.SpecError, match=r"^rounds\[1\].from_round: no earlier round named 'nope'"):
        study(from_round="nope")
    raw = spec.to_dict(study())
    raw["rounds"] = raw["rounds"][::-1]
    with pytest.raises(spec.SpecError, match=r"^rounds\[0\].kind: the first round cannot extend"):
        spec.load_dict(raw)
