"""The optional MLflow mirror (`tracking.mlflow_uri`): one MLflow experiment per study, one
run per trial, named after the trial. Params: the trial's hyperparameters, max_train_steps and
round; metrics: every scalar of each evaluation report, at its step; tags: the study, the git
commit (and whether the tree was dirty), the stored study file and the trial's final status.

mlflow is imported here only, and this module only when a study asks for the mirror, so the
service has no MLflow dependency unless it is used (`pip install mlflow-skinny` is enough).
The mirror uses `MlflowClient` with explicit run ids (no global "active run"), because the
coordinator's trial events may arrive on several threads.
"""

from __future__ import annotations

import functools
import math
import os
import threading

from service.core.errors import SpecError
from service.core.trial_status import TrialStatus
from service.study.spec import Study
from service.tracking import provenance

# MLflow 3 refuses its file store (file:// URIs, plain paths) unless this is set; the file
# store is what a team without an MLflow server can use on shared storage.
FILE_STORE_ENV = "MLFLOW_ALLOW_FILE_STORE"
MLFLOW_END = {TrialStatus.FAILED: "FAILED", TrialStatus.STOPPED: "KILLED"}
"""The MLflow run status a trial's end sets (else FINISHED); a rerun sets RUNNING again."""


def best_effort(method):
    """A mirror that cannot reach MLflow warns in the job log; it never stops the study."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any MLflow client error
            print(f"warning: MLflow mirror: {method.__name__}: {type(e).__name__}: {e}", flush=True)

    return wrapper


def check_available(study: Study) -> None:
    """Before a study starts: a mirror was asked for, so mlflow must import (exit 2 if not)."""
    if study.tracking.mlflow_uri:
        try:
            import mlflow  # noqa: F401
        except ImportError:
            raise SpecError(
                "tracking.mlflow_uri: mlflow is not installed (pip install mlflow-skinny)"
            ) from None


class MlflowMirror:
    def __init__(self, tracking_uri: str, study: Study):
        if "://" not in tracking_uri or tracking_uri.startswith("file:"):
            os.environ.setdefault(FILE_STORE_ENV, "true")
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise SpecError(
                "tracking.mlflow_uri: mlflow is not installed (pip install mlflow-skinny)"
            ) from None
        self.client = MlflowClient(tracking_uri)
        self.study = study
        self.tags = {
            "playbook.study": study.name,
            "playbook.study_file": study.layout.study_file,
        }
        prov = provenance.read(study.study_uri)
        if prov:
            self.tags.update(
                {
                    "mlflow.source.git.commit": prov.get("git_commit") or "",
                    "git_commit": prov.get("git_commit") or "",
                    "git_dirty": str(bool(prov.get("git_dirty"))).lower(),
                }
            )
        self._experiment_id: str | None = None  # looked up at the first trial: MLflow may be down now
        self._runs: dict[str, str] = {}
        self._lock = threading.Lock()

    @property
    def experiment_id(self) -> str:
        if self._experiment_id is None:
            experiment = self.client.get_experiment_by_name(self.study.name)
            self._experiment_id = (
                experiment.experiment_id if experiment else self.client.create_experiment(self.study.name)
            )
        return self._experiment_id

    def _run_id(self, trial: dict) -> str:
        name = trial["trial_name"]
        with self._lock:
            if name not in self._runs:
                found = self.client.search_runs(
                    [self.experiment_id], filter_string=f"tags.`mlflow.runName` = '{name}'", max_results=1
                )
                if found:  # a resumed study keeps mirroring into the trial's earlier run
                    self._runs[name] = found[0].info.run_id
                    self.client.update_run(found[0].info.run_id, status="RUNNING")
                else:
                    run = self.client.create_run(
                        self.experiment_id,
                        run_name=name,
                        tags={**self.tags, "playbook.round": str(trial.get("round", ""))},
                    )
                    self._runs[name] = run.info.run_id
                    params = {**trial.get("hparams", {}), "max_train_steps": trial.get("max_train_steps")}
                    for k, v in params.items():
                        self.client.log_param(run.info.run_id, k, v)
            return self._runs[name]

    @best_effort
    def trial_started(self, trial: dict) -> None:
        self._run_id(trial)

    @best_effort
    def report(self, trial_name: str, result: dict) -> None:
        run_id = self._runs.get(trial_name)
        step = result.get("step")
        if run_id is None or not isinstance(step, int):
            return
        for key, value in result.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, float | int):
                continue
            if math.isfinite(value):
                self.client.log_metric(run_id, key, float(value), step=step)

    @best_effort
    def trial_done(self, trial_name: str, row: dict) -> None:
        run_id = self._runs.get(trial_name)
        if run_id is None:
            return
        status = row.get("status", TrialStatus.FINISHED)
        best = row.get("best_metric")
        if isinstance(best, float | int) and math.isfinite(best) and status == TrialStatus.FINISHED:
            self.client.log_metric(run_id, "best_metric", float(best), step=int(row.get("best_step") or 0))
        for key in ("best_step", "best_checkpoint", "diverged_at_step"):
            if row.get(key) is not None:
                self.client.set_tag(run_id, f"playbook.{key}", str(row[key]))
        self.client.set_tag(run_id, "playbook.status", status)
        self.client.set_terminated(run_id, MLFLOW_END.get(status, "FINISHED"))
