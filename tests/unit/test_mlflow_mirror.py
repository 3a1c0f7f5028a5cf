"""The MLflow mirror is best effort from its first call: an MLflow server that cannot be reached
when the study starts (or later) gives warnings in the job log, never an error that stops it."""

from __future__ import annotations

from service.tracking.mlflow_mirror import MlflowMirror
from tests.helpers.processes import free_ports
from tests.helpers.studies import make_study


def test_an_unreachable_mlflow_server_only_warns(digits_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    (port,) = free_ports(1)  # nothing listens there
    study = make_study(digits_dir, tmp_path)
    mirror = MlflowMirror(f"http://127.0.0.1:{port}", study)  # no request yet: cannot fail
    trial = {"trial_name": "explore-0000", "round": "explore", "hparams": {"learning_rate": 0.1}}
    mirror.trial_started(trial)
    mirror.report("explore-0000", {"step": 20, "validation/loss": 0.5})
    mirror.trial_done("explore-0000", {"status": "FINISHED", "best_metric": 0.5, "best_step": 20})
    out = capsys.readouterr().out
    assert out.startswith("warning: MLflow mirror: trial_started: ")
    assert f"127.0.0.1:{port}" in out
