"""The coordinator's Ray metrics (`ray.util.metrics`), tagged by study: they reach every Ray
node's Prometheus endpoint and the dashboard's metrics page, with Ray's `ray_` prefix
(`ray_playbook_trials_running{study="..."}`).

Values come from the trial table and from the Tune reports the coordinator already receives;
per-trial rates are kept as one number per running trial (no history). Ray's metrics agent
drops a gauge value that its process has not re-sent for two export intervals (~20 s), so the
coordinator republishes every gauge every `REPUBLISH_S` (a trial may go minutes between
evaluations) -- see `start_republishing`.
"""

from __future__ import annotations

import math
import threading

from ray.util.metrics import Counter, Gauge

from service.core import ranking
from service.core.trial_status import TrialStatus

TAG_KEYS = ("study",)
REPUBLISH_S = 5.0


def exposed_input_fraction(result: dict) -> float | None:
    """The exposed input fraction of a report, if the trainer reports one (any key ending
    in `exposed_input_fraction` or `input/exposed_fraction`)."""
    for key, value in result.items():
        if key.endswith(("exposed_input_fraction", "input/exposed_fraction")) and isinstance(
            value, float | int
        ):
            return float(value)
    return None


class StudyMetrics:
    def __init__(self, study_name: str, mode: str):
        self.tags = {"study": study_name}
        self.mode = mode
        self._steps_per_s: dict[str, float] = {}
        self._exposed: dict[str, float] = {}
        self._best: float | None = None
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()

        def gauge(name: str, description: str) -> Gauge:
            return Gauge(f"playbook_{name}", description=description, tag_keys=TAG_KEYS)

        self.trials = {
            status: gauge(f"trials_{status.lower()}", f"trials of the study that are {status}")
            for status in TrialStatus
        }
        self.steps_per_s = gauge("steps_per_s", "training steps per second, summed over running trials")
        self.exposed_input = gauge(
            "exposed_input_fraction", "mean exposed input fraction of running trials (when reported)"
        )
        self.best_metric = gauge("best_metric", "best validation metric so far (over every report)")
        self.reports = Counter(
            "playbook_trial_reports", description="evaluation reports received", tag_keys=TAG_KEYS
        )

    def on_rows(self, rows: list[dict]) -> None:
        """Trial counts by status, from the trial table."""
        with self._lock:
            self._counts = {st: sum(1 for r in rows if r.get("status") == st) for st in self.trials}
        self.publish()

    def on_report(self, trial_name: str, result: dict, metric: str) -> None:
        self.reports.inc(1, tags=self.tags)
        rate, exposed, value = result.get("steps_per_s"), exposed_input_fraction(result), result.get(metric)
        with self._lock:
            if isinstance(rate, float | int) and math.isfinite(rate):
                self._steps_per_s[trial_name] = float(rate)
            if exposed is not None:
                self._exposed[trial_name] = exposed
            finite = isinstance(value, float | int) and math.isfinite(value)
            if result.get("status") != TrialStatus.DIVERGED.reported and finite:
                if self._best is None or ranking.key(value, self.mode) < ranking.key(self._best, self.mode):
                    self._best = float(value)
        self.publish()

    def on_trial_done(self, trial_name: str) -> None:
        with self._lock:
            self._steps_per_s.pop(trial_name, None)
            self._exposed.pop(trial_name, None)
        self.publish()

    def publish(self) -> None:
        """Set every gauge to its current value."""
        with self._lock:
            for status, g in self.trials.items():
                g.set(self._counts.get(status, 0), tags=self.tags)
            self.steps_per_s.set(sum(self._steps_per_s.values()), tags=self.tags)
            if self._exposed:
                self.exposed_input.set(sum(self._exposed.values()) / len(self._exposed), tags=self.tags)
            if self._best is not None:
                self.best_metric.set(self._best, tags=self.tags)

    def start_republishing(self, interval_s: float = REPUBLISH_S) -> None:
        """A daemon thread that republishes the gauges until `stop` (or the process ends)."""

        def loop() -> None:
            while not self._stop.wait(interval_s):
                self.publish()

        threading.Thread(target=loop, name="playbook-metrics", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
