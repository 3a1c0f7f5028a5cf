"""The curve verdicts on real digits trials trained by the step loop (no Ray): the kinds that
fire equal a numpy reading of the metrics log by the rules of docs/verdicts.md
(tests/helpers/curve_rules.py). A high constant learning rate gives a noisy tail; the clipping
verdict suggests the 90th percentile of the logged norms of this trial that does not clip."""

from __future__ import annotations

import numpy as np

from service.analysis import curves
from service.distributed.topology import Topology
from service.study.sections import Curves
from service.trainer.loop import train
from tests.helpers.curve_rules import plain_curve_kinds
from tests.helpers.trainer_runs import Reporter, make_plan, read_log

STEPS, EVERY = 40, 4


def test_a_real_trials_curve_verdicts_are_the_plain_reading_of_its_log(digits_dir, tmp_path):
    plan = make_plan(
        digits_dir,
        tmp_path / "s",
        hparams={"learning_rate": 0.5, "momentum": 0.9, "width": 4},
        max_train_steps=STEPS,
        eval_every_steps=EVERY,
        schedule={"kind": "constant"},
    )
    reporter = Reporter(tmp_path)
    train(plan, Topology(), reporter)
    log = read_log(plan)
    best_step = reporter.metrics[-1]["best_step"]
    row = {"trial_name": "r1-0", "status": "FINISHED", "max_train_steps": STEPS, "best_step": best_step}
    found = curves.trial_verdicts(row, log, "validation/loss", "min", Curves())
    warned = {v.kind for v in found if v.is_warning}
    assert warned == plain_curve_kinds(log, STEPS, best_step)
    assert "late_noise" in warned
    (clip,) = [v for v in found if v.kind == "clipping"]
    norms = [h["train/grad_norm"] for h in log]
    assert len(norms) == STEPS // EVERY and clip.facts["suggested_clip"] == np.percentile(norms, 90)
