"""A learning rate or weight decay that no optimizer accepts is refused by `playbook validate`
naming the field, instead of failing every trial when it builds its optimizer."""

from __future__ import annotations

import copy

import pytest

from service.core.errors import SpecError
from service.study import spec
from tests.helpers.studies import MINIMAL_STUDY


def study_with(**search):
    d = copy.deepcopy(MINIMAL_STUDY)
    d["search"].update(search)
    return d


@pytest.mark.parametrize(
    "name, hp, message",
    [
        ("learning_rate", {"role": "fixed", "value": -0.1}, "a learning rate: must be >= 0 (got -0.1)"),
        (
            "learning_rate",
            {"role": "nuisance", "min": -1, "max": 1},
            "a learning rate: must be >= 0 (got -1.0)",
        ),
        ("learning_rate", {"role": "fixed", "value": "fast"}, "a learning rate: must be a number (got fast)"),
        ("weight_decay", {"role": "fixed", "value": -1e-4}, "a weight decay: must be >= 0 (got -0.0001)"),
        (
            "learning_rate",
            {"role": "fixed", "value": 1e300},
            "a learning rate: must be at most 3.403e+38, the largest float32 (got 1e+300)",
        ),
        (
            "weight_decay",
            {"role": "nuisance", "min": 0.0, "max": 1e39},
            "a weight decay: must be at most 3.403e+38, the largest float32 (got 1e+39)",
        ),
    ],
)
def test_a_learning_rate_or_weight_decay_no_optimizer_takes_is_refused_naming_the_field(name, hp, message):
    with pytest.raises(SpecError) as e:
        spec.load_dict(study_with(**{name: hp}))
    assert str(e.value) == f"search.{name}: {message}"


def test_a_zero_weight_decay_and_a_small_learning_rate_are_accepted():
    s = spec.load_dict(study_with(weight_decay={"role": "fixed", "value": 0.0}))
    assert s.search["weight_decay"].value == 0.0 and s.search["learning_rate"].min == 0.01


def test_a_zero_learning_rate_is_accepted_as_torch_accepts_it():
    """A learning rate of 0 trains nothing: an untrained baseline, or ties on purpose
    (tests/cluster/test_exact_layout.py); torch's optimizers take it."""
    s = spec.load_dict(study_with(learning_rate={"role": "fixed", "value": 0}))
    assert s.search["learning_rate"].value == 0
