"""A study that cannot go on says why in one line: an error of the coordinator's (bad input, a
PlaybookError) reaches `playbook run` as that error, not as Ray's task error with its traceback."""

from __future__ import annotations

import pytest

from service.core.errors import PlaybookError
from tests.helpers.studies import make_study


def test_an_extend_round_after_a_round_that_only_diverged_is_one_line(ray_cluster, digits_dir, tmp_path):
    from service.orchestration.study_run import run_study

    study = make_study(
        digits_dir,
        tmp_path,
        training={"max_train_steps": 10, "eval_every_steps": 5, "schedule": {"kind": "constant"}},
        search={
            "learning_rate": {"role": "fixed", "value": 1.0e30},
            "momentum": {"role": "fixed", "value": 0.9},
            "width": {"role": "fixed", "value": 4},
        },
        rounds=[{"name": "explore", "num_trials": 1}, {"name": "longer", "kind": "extend", "num_trials": 1}],
    )
    with pytest.raises(PlaybookError) as e:
        run_study(study)
    assert str(e.value) == "round longer: round explore has no finished trial to extend"
    assert e.value.exit_code == 1  # the study stopped; its file was fine (bad input is 2)
