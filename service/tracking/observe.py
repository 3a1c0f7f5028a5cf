"""What watches a running study from inside its coordinator: the progress lines, the Ray
metrics, the storage root's study index and the optional MLflow mirror. The coordinator
builds one `StudyObservers`; its `TrialEvents` feed it Tune's trial events."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from service.study.spec import Study
from service.tracking import provenance, study_index
from service.tracking.coalesce import Coalesced
from service.tracking.progress import ProgressLimiter

# A running study recompiles its storage root's study table at most this often (and when it
# ends): a compile reads every study's index object, so it costs O(studies in the root).
COMPILE_MIN_INTERVAL_S = 10.0


class RowsObserver(Protocol):
    """What counts a study's rows as they change and follows its trials (the Ray metrics,
    `orchestration.study_metrics`)."""

    def on_rows(self, rows: list[dict]) -> None: ...

    def on_trial_started(self, trial: dict) -> None: ...

    def on_report(self, trial: dict, result: dict, metric: str) -> None: ...

    def on_trial_done(self, trial_name: str) -> None: ...


@dataclass
class StudyObservers:
    study: Study
    metrics: RowsObserver
    limiter: ProgressLimiter = field(default_factory=ProgressLimiter)
    mirror: object | None = None
    """An `mlflow_mirror.MlflowMirror` when `tracking.mlflow_uri` is set."""
    provenance: dict | None = None
    """The study's provenance record (written by `playbook run` before the study starts)."""

    @classmethod
    def for_study(cls, study: Study, metrics: RowsObserver) -> StudyObservers:
        mirror = None
        uri = getattr(getattr(study, "tracking", None), "mlflow_uri", None)
        if uri:
            from service.tracking.mlflow_mirror import (
                MlflowMirror,  # mlflow is imported only when used
            )

            mirror = MlflowMirror(uri, study)
        return cls(
            study,
            metrics,
            mirror=mirror,
            provenance=provenance.read(study.study_uri),
        )

    def __post_init__(self) -> None:
        self.compiles = Coalesced(
            lambda: study_index.compile_table(self.study.storage), min_interval_s=COMPILE_MIN_INTERVAL_S
        )

    def rows_changed(self, rows: list[dict], state: str = "running") -> None:
        """A trial changed state: counts to the metrics, the study's row to its index object,
        and the root's table recompiled (coalesced while the study runs; at once at its end)."""
        self.metrics.on_rows(rows)
        study_index.record_study(self.study, rows, state, self.provenance)
        if state == "running":
            self.compiles.request()
        else:
            self.compiles.flush()
