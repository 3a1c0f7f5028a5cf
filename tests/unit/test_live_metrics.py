"""The series a study's coordinator publishes (`tracking.live_metrics`), on hand-made trial events
and rows: per-trial series only while the trial runs, the best metric by mode with diverged
reports left out, restarts and failed attempts per round from the reported attempt numbers."""

from __future__ import annotations

import math

from service.tracking.live_metrics import LiveMetrics


def trial(name: str, rnd: str = "explore", total: int = 100) -> dict:
    return {"trial_name": name, "round": rnd, "max_train_steps": total}


def test_a_running_trials_series_from_start_to_done():
    m = LiveMetrics("min")
    m.on_started(trial("explore-0000"))
    assert m.trial_series() == {"explore-0000": ("explore", {"trial_step": 0.0, "trial_total_steps": 100.0})}
    report = {"step": 20, "steps_per_s": 12.5, "eval_s": 0.25, "checkpoint_s": 0.5}
    m.on_report(trial("explore-0000"), {**report, "input/exposed_fraction": 0.1, "m": 3.0}, "m")
    m.on_report(trial("explore-0001"), {"step": 40, "steps_per_s": 7.5, "m": 2.0}, "m")
    assert m.trial_series()["explore-0000"] == (
        "explore",
        {
            "trial_step": 20.0,
            "trial_total_steps": 100.0,
            "trial_steps_per_s": 12.5,
            "trial_eval_s": 0.25,
            "trial_checkpoint_s": 0.5,
            "trial_exposed_input_fraction": 0.1,
        },
    )
    study = m.study_series()
    assert study["steps_per_s"] == 20.0 and study["best_metric"] == 2.0
    assert study["exposed_input_fraction"] == 0.1  # the one trial that reports it
    m.on_done("explore-0000")
    assert list(m.trial_series()) == ["explore-0001"]
    assert m.study_series()["steps_per_s"] == 7.5


def test_best_metric_by_mode_without_diverged_or_nan_reports():
    for mode, values, best in (("min", [3.0, 1.5, 2.0], 1.5), ("max", [0.5, 0.9, 0.7], 0.9)):
        m = LiveMetrics(mode)
        for i, v in enumerate(values):
            m.on_report(trial(f"t{i}"), {"step": 10, "acc": v}, "acc")
        worst = -math.inf if mode == "min" else math.inf
        m.on_report(trial("d"), {"step": 10, "acc": worst, "status": "diverged"}, "acc")
        m.on_report(trial("n"), {"step": 10, "acc": math.nan}, "acc")
        assert m.study_series()["best_metric"] == best


def test_counts_restarts_and_failed_attempts_per_round():
    m = LiveMetrics("min")
    rows = [
        {"trial_name": "a-0", "round": "a", "status": "FINISHED"},
        {"trial_name": "a-1", "round": "a", "status": "FAILED"},
        {"trial_name": "b-0", "round": "b", "status": "RUNNING"},
        {"trial_name": "b-1", "round": "b", "status": "DIVERGED"},
        {"trial_name": "b-2", "round": "b", "status": "STOPPED"},
    ]
    m.on_rows(rows)
    counts = {k: v for k, v in m.study_series().items() if k.startswith("trials_")}
    assert counts == {
        "trials_pending": 0.0,
        "trials_running": 1.0,
        "trials_finished": 1.0,
        "trials_diverged": 1.0,
        "trials_failed": 1.0,
        "trials_stopped": 1.0,
    }
    # b-0's third attempt reports (two restarts), then its second again (an old report): still 2
    for attempt in (1, 3, 2):
        m.on_report(trial("b-0", "b"), {"step": 10, "attempt": attempt}, "m")
    m.on_report(trial("a-0", "a"), {"step": 10, "attempt": 1}, "m")
    assert m.round_series() == {
        "a": {"worker_group_restarts": 0.0, "failed_attempts": 1.0},  # a-1's failed last attempt
        "b": {"worker_group_restarts": 2.0, "failed_attempts": 2.0},
    }
    assert m.attempts == {"b-0": ("b", 3)}  # nothing kept for trials never restarted
