"""What a running study's metrics say now, as series (name, tags, value): plain Python, kept by
the coordinator from the trial table and the Tune reports; `orchestration.study_metrics` sets
them on Ray gauges (`ray_playbook_<name>`), which Prometheus scrapes and
deploy/grafana/playbook-study.json draws.

How the series grow (docs/deploying.md, "Cardinality"):
- per study: one series per trial state, the best metric, steps/s and exposed input fraction
  summed or averaged over running trials;
- per study and round: worker-group restarts and failed attempts (a round's series stay while
  the study runs: rounds are few, written in the study file);
- per running trial (tags study, round, trial): step, total steps, steps/s, evaluation time,
  checkpoint time, exposed input fraction. A trial's series are published only while it runs:
  once it is done they are no longer re-sent and Ray's metrics agent drops them, so they number
  6 x the trials running at once, however many trials the study has.

What is kept per trial besides the running ones: the highest attempt of a trial that was
restarted (one number per restarted trial).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from service.core import ranking
from service.core.trial_status import TrialStatus

TRIAL_SERIES = ("trial_step", "trial_total_steps", "trial_steps_per_s", "trial_eval_s", "trial_checkpoint_s")
TRIAL_EXPOSED = "trial_exposed_input_fraction"
ROUND_SERIES = ("worker_group_restarts", "failed_attempts")


def exposed_input_fraction(result: dict) -> float | None:
    """The exposed input fraction of a report, if the trainer reports one (any key ending
    in `exposed_input_fraction` or `input/exposed_fraction`)."""
    for key, value in result.items():
        if key.endswith(("exposed_input_fraction", "input/exposed_fraction")) and finite(value):
            return float(value)
    return None


def finite(value) -> bool:
    return isinstance(value, float | int) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class RunningTrial:
    round: str
    total_steps: int
    step: int = 0
    steps_per_s: float | None = None
    eval_s: float | None = None
    checkpoint_s: float | None = None
    exposed: float | None = None

    def series(self) -> dict[str, float]:
        values = {
            "trial_step": self.step,
            "trial_total_steps": self.total_steps,
            "trial_steps_per_s": self.steps_per_s,
            "trial_eval_s": self.eval_s,
            "trial_checkpoint_s": self.checkpoint_s,
            TRIAL_EXPOSED: self.exposed,
        }
        return {k: float(v) for k, v in values.items() if v is not None}


class LiveMetrics:
    """The study's series now. `on_rows` takes the trial table; `on_started`, `on_report` and
    `on_done` take Tune's trial events (`trial`: the trial's plan, with `trial_name`, `round`
    and `max_train_steps`)."""

    def __init__(self, mode: str):
        self.mode = mode
        self.counts: dict[str, int] = {}
        self.failed_by_round: dict[str, int] = {}
        self.best: float | None = None
        self.running: dict[str, RunningTrial] = {}
        self.attempts: dict[str, tuple[str, int]] = {}  # restarted trial -> (round, highest attempt)

    def on_rows(self, rows: list[dict]) -> None:
        self.counts = {s: sum(1 for r in rows if r.get("status") == s) for s in TrialStatus}
        failed: dict[str, int] = {}
        for r in rows:
            rnd = str(r.get("round"))
            failed[rnd] = failed.get(rnd, 0) + (r.get("status") == TrialStatus.FAILED)
        self.failed_by_round = failed

    def on_started(self, trial: dict) -> None:
        name = trial["trial_name"]
        if name not in self.running:
            self.running[name] = RunningTrial(str(trial.get("round")), int(trial["max_train_steps"]))

    def on_report(self, trial: dict, result: dict, metric: str) -> None:
        self.on_started(trial)
        running = self.running[trial["trial_name"]]
        if finite(result.get("step")):
            running.step = int(result["step"])
        for field in ("steps_per_s", "eval_s", "checkpoint_s"):
            if finite(result.get(field)):
                setattr(running, field, float(result[field]))
        running.exposed = exposed_input_fraction(result)
        attempt = result.get("attempt")
        if finite(attempt) and attempt > max(1, self.attempts.get(trial["trial_name"], ("", 1))[1]):
            self.attempts[trial["trial_name"]] = (running.round, int(attempt))
        value = result.get(metric)
        if result.get("status") != TrialStatus.DIVERGED.reported and finite(value):
            if self.best is None or ranking.key(value, self.mode) < ranking.key(self.best, self.mode):
                self.best = float(value)

    def on_done(self, trial_name: str) -> None:
        self.running.pop(trial_name, None)

    def study_series(self) -> dict[str, float]:
        """name -> value of the study-wide series."""
        out = {f"trials_{s.lower()}": float(self.counts.get(s, 0)) for s in TrialStatus}
        out["steps_per_s"] = sum(t.steps_per_s or 0.0 for t in self.running.values())
        exposed = [t.exposed for t in self.running.values() if t.exposed is not None]
        if exposed:
            out["exposed_input_fraction"] = sum(exposed) / len(exposed)
        if self.best is not None:
            out["best_metric"] = self.best
        return out

    def round_series(self) -> dict[str, dict[str, float]]:
        """round -> {worker_group_restarts, failed_attempts}: a restart is an attempt at a trial
        after its first (each one followed a failed attempt); a failed trial's last attempt failed too."""
        restarts = {r: 0 for r in self.failed_by_round}
        for rnd, attempt in self.attempts.values():
            restarts[rnd] = restarts.get(rnd, 0) + attempt - 1
        return {
            r: {
                "worker_group_restarts": float(n),
                "failed_attempts": float(n + self.failed_by_round.get(r, 0)),
            }
            for r, n in restarts.items()
        }

    def trial_series(self) -> dict[str, tuple[str, dict[str, float]]]:
        """trial -> (round, name -> value) of each running trial."""
        return {name: (t.round, t.series()) for name, t in self.running.items()}
