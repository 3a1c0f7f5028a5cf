"""The coordinator's Ray metrics (`ray.util.metrics`): the series of `tracking.live_metrics` on
Ray gauges, tagged by study (and round, and trial for a running trial's). They reach the head
node's Prometheus endpoint and the dashboard's metrics page with Ray's `ray_` prefix
(`ray_playbook_trials_running{study="..."}`); deploy/grafana/playbook-study.json draws them.

Ray's metrics agent drops a gauge value that its process has not re-sent for two export
intervals (`metrics_report_interval_ms`, 10 s by default), so the coordinator republishes every
series it still has twice per interval (`start_republishing`; a trial may go minutes between
evaluations), and a series it no longer has (a trial that is done) leaves Prometheus by itself.
A value reaches the agent at the process's next export: a study's last counts reach it only if
its coordinator lives one export interval past its last change (`exported_in_s`).
"""

from __future__ import annotations

import threading
import time

from ray.util.metrics import Counter, Gauge

from service.orchestration import ray_private
from service.tracking.live_metrics import ROUND_SERIES, TRIAL_EXPOSED, TRIAL_SERIES, LiveMetrics

DESCRIPTIONS = {
    "trials_pending": "trials of the study that are PENDING",
    "trials_running": "trials of the study that are RUNNING",
    "trials_finished": "trials of the study that are FINISHED",
    "trials_diverged": "trials of the study that are DIVERGED",
    "trials_failed": "trials of the study that are FAILED",
    "trials_stopped": "trials of the study that were running when it stopped (STOPPED)",
    "steps_per_s": "training steps per second, summed over running trials",
    "exposed_input_fraction": "mean exposed input fraction of running trials (when reported)",
    "best_metric": "best validation metric so far (over every report)",
    "worker_group_restarts": "attempts at the round's trials after their first",
    "failed_attempts": "attempts at the round's trials that failed (restarted or FAILED)",
    "trial_step": "a running trial's latest reported step",
    "trial_total_steps": "a running trial's max_train_steps",
    "trial_steps_per_s": "a running trial's training steps per second (its last evaluation interval)",
    "trial_eval_s": "a running trial's last evaluation time (s)",
    "trial_checkpoint_s": "a running trial's last checkpoint time (s)",
    TRIAL_EXPOSED: "a running trial's exposed input fraction (when reported)",
}
EXPORT_MARGIN_S = 0.5
"""Past one export interval after a change: the export has surely happened."""
STUDY_SERIES = tuple(n for n in DESCRIPTIONS if n not in ROUND_SERIES + TRIAL_SERIES + (TRIAL_EXPOSED,))


class StudyMetrics:
    def __init__(self, study_name: str, mode: str):
        self.tags = {"study": study_name}
        self.values = LiveMetrics(mode)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._changed = time.monotonic()
        keys = {
            **{n: ("study",) for n in STUDY_SERIES},
            **{n: ("study", "round") for n in ROUND_SERIES},
            **{n: ("study", "round", "trial") for n in (*TRIAL_SERIES, TRIAL_EXPOSED)},
        }
        self.gauges = {
            n: Gauge(f"playbook_{n}", description=DESCRIPTIONS[n], tag_keys=keys[n]) for n in DESCRIPTIONS
        }
        self.reports = Counter(
            "playbook_trial_reports", description="evaluation reports received", tag_keys=("study",)
        )

    def on_rows(self, rows: list[dict]) -> None:
        """Trial counts by status, from the trial table."""
        self._change(self.values.on_rows, rows)

    def on_trial_started(self, trial: dict) -> None:
        self._change(self.values.on_started, trial)

    def on_report(self, trial: dict, result: dict, metric: str) -> None:
        self.reports.inc(1, tags=self.tags)
        self._change(self.values.on_report, trial, result, metric)

    def on_trial_done(self, trial_name: str) -> None:
        self._change(self.values.on_done, trial_name)

    def _change(self, update, *args) -> None:
        with self._lock:
            update(*args)
            self._changed = time.monotonic()
        self.publish()

    def publish(self) -> None:
        """Set every series the study has now."""
        with self._lock:
            for name, value in self.values.study_series().items():
                self.gauges[name].set(value, tags=self.tags)
            for rnd, series in self.values.round_series().items():
                for name, value in series.items():
                    self.gauges[name].set(value, tags={**self.tags, "round": rnd})
            for trial, (rnd, series) in self.values.trial_series().items():
                for name, value in series.items():
                    self.gauges[name].set(value, tags={**self.tags, "round": rnd, "trial": trial})

    def exported_in_s(self) -> float:
        """Seconds until Ray has surely exported the latest change of a series."""
        due = self._changed + ray_private.metrics_export_interval_s() + EXPORT_MARGIN_S
        return max(0.0, due - time.monotonic())

    def start_republishing(self, interval_s: float | None = None) -> None:
        """A daemon thread that republishes the series until `stop` (or the process ends),
        every half of Ray's metrics export interval unless `interval_s` says otherwise."""
        interval_s = interval_s or ray_private.metrics_export_interval_s() / 2

        def loop() -> None:
            while not self._stop.wait(interval_s):
                self.publish()

        threading.Thread(target=loop, name="playbook-metrics", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
