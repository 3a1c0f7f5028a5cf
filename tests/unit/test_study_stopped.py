"""A study stopped under its running trials (Ctrl-C, SIGTERM, an error that ends it): those
trials are STOPPED in the trial table and KILLED in the MLflow mirror; finished and pending
trials keep their status; a rerun that starts a stopped trial again mirrors into the same
MLflow run, RUNNING again."""

from __future__ import annotations

import subprocess
import sys

from service.core.trial_status import DONE, TrialStatus
from service.tracking import study_index
from service.tracking.observe import StudyObservers
from service.tracking.trial_events import TrialEvents
from service.tracking.trial_table import TrialTable, read_rows
from tests.helpers.studies import make_study

METRIC = "validation/error"


def trial(name: str) -> dict:
    return {"trial_name": name, "round": "explore", "max_train_steps": 40, "hparams": {"learning_rate": 0.1}}


class NoMetrics:
    """The Ray metrics' place among the observers (they need a Ray actor; not what is tested)."""

    def on_rows(self, rows):
        pass

    def on_trial_started(self, trial):
        pass

    def on_report(self, trial, result, metric):
        pass

    def on_trial_done(self, trial_name):
        pass


def study_events(study) -> TrialEvents:
    table = TrialTable(study.study_uri, METRIC, "min")
    table.load_existing()
    observers = StudyObservers.for_study(study, NoMetrics())
    return TrialEvents(table, observers, METRIC)


def studies_table(study) -> dict:
    """`playbook studies` (run as a user runs it) on the study's root after the coordinator
    recorded its row: the columns of the study's line that count trials, and its state."""
    study_index.record_study(study, read_rows(study.study_uri), "stopped", None)
    out = subprocess.run(
        [sys.executable, "-m", "service", "studies", "--storage", study.storage],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    header, line = out.stdout.splitlines()[:2]
    row = dict(zip(header.split(), line.split(), strict=True))
    return {k: v for k, v in row.items() if k == "state" or k.startswith("trials")}


def test_running_trials_are_stopped_in_the_table_and_killed_in_mlflow(digits_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mlruns = tmp_path / "mlruns"
    study = make_study(digits_dir, tmp_path / "storage", tracking={"mlflow_uri": f"file://{mlruns}"})
    events = study_events(study)
    for name in ("explore-0000", "explore-0001", "explore-0002"):  # planned, as the coordinator does
        events.table.update(name, round="explore", status=TrialStatus.PENDING, max_train_steps=40)
    for name in ("explore-0000", "explore-0001"):
        events.started(trial(name))
        events.result(trial(name), {"step": 20, METRIC: 0.5})
    summary = {"summary": True, "status": "finished", METRIC: 0.4, "best_step": 20}
    events.result(trial("explore-0001"), summary)

    assert events.study_stopped() == ["explore-0000"]
    events.table.save()

    status = {r["trial_name"]: (r["status"], r.get("step")) for r in read_rows(study.study_uri)}
    assert status == {
        "explore-0000": ("STOPPED", 20),  # where a rerun says it resumes
        "explore-0001": ("FINISHED", 20),
        "explore-0002": ("PENDING", None),
    }
    assert TrialStatus.STOPPED not in DONE  # a rerun starts it again
    counts = {
        "trials": "3",
        "trials_finished": "1",
        "trials_diverged": "0",
        "trials_failed": "0",
        "trials_stopped": "1",
    }
    assert studies_table(study) == {"state": "stopped", **counts}

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"file://{mlruns}")
    experiment = client.get_experiment_by_name(study.name).experiment_id
    runs = {r.info.run_name: r for r in client.search_runs([experiment])}
    ended = {n: r.info.status for n, r in runs.items()}
    assert ended == {"explore-0000": "KILLED", "explore-0001": "FINISHED"}
    assert runs["explore-0000"].data.tags["playbook.status"] == "STOPPED"

    rerun = study_events(study)  # the study run again: its coordinator's new mirror
    rerun.started(trial("explore-0000"))
    again = {r.info.run_name: r for r in client.search_runs([experiment])}
    assert len(again) == 2 and again["explore-0000"].info.run_id == runs["explore-0000"].info.run_id
    assert again["explore-0000"].info.status == "RUNNING"
    assert rerun.table.rows["explore-0000"]["status"] == TrialStatus.RUNNING
