"""A study's last metric values reach Prometheus only if its coordinator lives until Ray's next
export after them (`StudyMetrics.exported_in_s`, `run_study(settle_metrics=True)`): the wait
counts from the last change of a value, not from the republishing that keeps gauges alive."""

from __future__ import annotations

import time

import pytest

from service.orchestration import ray_private
from service.orchestration.study_metrics import EXPORT_MARGIN_S, StudyMetrics


def test_the_wait_runs_one_export_interval_from_the_last_change_not_from_a_republish(monkeypatch):
    monkeypatch.setattr(ray_private, "metrics_export_interval_s", lambda: 1.0)
    m = StudyMetrics("s", "min")
    m.on_rows([{"trial_name": "a", "status": "RUNNING"}])
    assert m.exported_in_s() == pytest.approx(1.0 + EXPORT_MARGIN_S, abs=0.05)
    time.sleep(0.5)
    m.publish()  # the republishing thread's work: nothing changed
    assert m.exported_in_s() == pytest.approx(0.5 + EXPORT_MARGIN_S, abs=0.1)
    m.on_rows([{"trial_name": "a", "status": "FINISHED"}])  # a change: its export is due again
    assert m.exported_in_s() == pytest.approx(1.0 + EXPORT_MARGIN_S, abs=0.05)
    time.sleep(1.0 + EXPORT_MARGIN_S)
    assert m.exported_in_s() == 0.0
