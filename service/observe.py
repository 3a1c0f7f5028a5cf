"""What watches a running study from inside its coordinator: the progress lines, the Ray
metrics, the storage root's study index and the optional MLflow mirror. The coordinator
builds one `StudyObservers`; its `TrialEvents` feed it Tune's trial events."""

from __future__ import annotations

from dataclasses import dataclass, field

from service import study_index
from service.progress import ProgressLimiter
from service.spec import Study
from service.study_metrics import StudyMetrics


@dataclass
class StudyObservers:
    study: Study
    metrics: StudyMetrics
    limiter: ProgressLimiter = field(default_factory=ProgressLimiter)
    mirror: object | None = None
    """An `mlflow_mirror.MlflowMirror` when `tracking.mlflow_uri` is set."""

    @classmethod
    def for_study(cls, study: Study) -> StudyObservers:
        mirror = None
        uri = getattr(getattr(study, "tracking", None), "mlflow_uri", None)
        if uri:
            from service.mlflow_mirror import MlflowMirror  # mlflow is imported only when used

            mirror = MlflowMirror(uri, study)
        return cls(study, StudyMetrics(study.name, study.training.mode), mirror=mirror)

    def rows_changed(self, rows: list[dict], state: str = "running") -> None:
        """A trial changed state: counts to the metrics, the study's row to the index."""
        self.metrics.on_rows(rows)
        study_index.record_study(self.study, rows, state)
