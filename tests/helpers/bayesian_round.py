"""A study with a `kind: bayesian` second round, and hand-made round-1 rows for it (small learning
rates trained well, the large ones diverged, one trial failed): shared by the tests of the round's
planning (tests/unit/test_bayesian_round.py) and of its Tune searcher
(tests/unit/test_bayesian_searcher.py)."""

from __future__ import annotations

import copy
import math

from service.core.trial_status import TrialStatus
from service.study import spec
from tests.helpers.studies import MINIMAL_STUDY


def study(**round2) -> spec.Study:
    """Round r1 (6 quasi-random trials), then r2 of kind bayesian with `round2`'s fields."""
    raw = copy.deepcopy(MINIMAL_STUDY)
    raw["search"] = {
        "learning_rate": {"role": "nuisance", "min": 0.001, "max": 1.0, "scale": "log"},
        "depth": {"role": "nuisance", "type": "int", "min": 1, "max": 8},
        "act": {"role": "scientific", "type": "choice", "values": ["relu", "tanh", "gelu"]},
        "width": {"role": "fixed", "value": 4},
    }
    raw["rounds"] = [
        {"name": "r1", "num_trials": 6},
        {"name": "r2", "kind": "bayesian", "num_trials": 3, **round2},
    ]
    return spec.load_dict(raw)


def row(i: int, lr: float, depth: int, act: str, metric: float | None, status=TrialStatus.FINISHED) -> dict:
    """Round r1's trial `i` as a row of the trial table."""
    return {
        "trial_name": f"r1-{i:04d}",
        "round": "r1",
        "status": status,
        "best_metric": metric,
        "hp/learning_rate": lr,
        "hp/depth": depth,
        "hp/act": act,
        "hp/width": 4,
    }


# Small learning rates train well; the large ones diverged (a region TPE must treat as bad).
ROWS = [
    row(0, 0.002, 2, "relu", 0.30),
    row(1, 0.010, 5, "tanh", 0.20),
    row(2, 0.004, 3, "relu", 0.25),
    row(3, 0.600, 7, "gelu", math.inf, TrialStatus.DIVERGED),
    row(4, 0.900, 1, "relu", math.inf, TrialStatus.DIVERGED),
    row(5, 0.050, 6, "gelu", 0.40),
    {**row(6, 0.3, 4, "tanh", None, TrialStatus.FAILED)},
]
