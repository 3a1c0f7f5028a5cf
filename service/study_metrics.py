"""The coordinator's Ray metrics (`ray.util.metrics`), tagged by study: they reach every Ray
node's Prometheus endpoint and the dashboard's metrics page, with Ray's `ray_` prefix
(`ray_playbook_trials_running{study="..."}`).

Values come from the trial table and from the Tune reports the coordinator already receives;
per-trial rates are kept as one number per running trial (no history).
"""

from __future__ import annotations

import math

from ray.util.metrics import Counter, Gauge

TAG_KEYS = ("study",)


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

        def gauge(name: str, description: str) -> Gauge:
            return Gauge(f"playbook_{name}", description=description, tag_keys=TAG_KEYS)

        self.trials = {
            status: gauge(f"trials_{status.lower()}", f"trials of the study that are {status}")
            for status in ("PENDING", "RUNNING", "FINISHED", "DIVERGED", "FAILED")
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
        for status, g in self.trials.items():
            g.set(sum(1 for r in rows if r.get("status") == status), tags=self.tags)

    def on_report(self, trial_name: str, result: dict, metric: str) -> None:
        self.reports.inc(1, tags=self.tags)
        rate = result.get("steps_per_s")
        if isinstance(rate, float | int) and math.isfinite(rate):
            self._steps_per_s[trial_name] = float(rate)
        exposed = exposed_input_fraction(result)
        if exposed is not None:
            self._exposed[trial_name] = exposed
        value = result.get(metric)
        if result.get("status") != "diverged" and isinstance(value, float | int) and math.isfinite(value):
            better = self._best is None or (value < self._best if self.mode == "min" else value > self._best)
            if better:
                self._best = float(value)
                self.best_metric.set(self._best, tags=self.tags)
        self._publish_rates()

    def on_trial_done(self, trial_name: str) -> None:
        self._steps_per_s.pop(trial_name, None)
        self._exposed.pop(trial_name, None)
        self._publish_rates()

    def _publish_rates(self) -> None:
        self.steps_per_s.set(sum(self._steps_per_s.values()), tags=self.tags)
        if self._exposed:
            self.exposed_input.set(sum(self._exposed.values()) / len(self._exposed), tags=self.tags)
