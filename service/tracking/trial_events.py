"""The coordinator's side of Tune's trial events: the trial table's rows, one line per event a
person cares about (`say`: a trial started or resumed, evaluated, finished, diverged, failed),
the study's Ray metrics and the MLflow mirror. Tune runs in another process
(`service.orchestration.tune_run`), whose callback sends each event here, one at a time and in order."""

from __future__ import annotations

from service.analysis.input_bound import INPUT_ROW_FIELDS
from service.analysis.verdicts import best_step_position
from service.core import storage
from service.core.errors import StorageError
from service.core.formatting import fmt
from service.core.trial_status import TrialStatus
from service.tracking.console import ConsoleLines
from service.tracking.observe import StudyObservers
from service.tracking.progress import ProgressLimiter, progress_line
from service.tracking.trial_table import TrialTable
from service.trainer import metrics_log


class TrialEvents:
    """`trial` is the trial's plan as Tune got it (`trial_name`, `max_train_steps`, ...)."""

    def __init__(
        self,
        table: TrialTable,
        observers: StudyObservers | None,
        metric: str,
        console: ConsoleLines | None = None,
    ):
        self.table, self.observers, self.metric = table, observers, metric
        self.console = console or ConsoleLines(keep=0, echo=True)  # printed, not kept
        self.say = self.console.say
        self.mirror = observers.mirror if observers else None
        self.limiter = observers.limiter if observers else ProgressLimiter(0)

    def started(self, trial: dict) -> None:
        name, total = trial["trial_name"], trial["max_train_steps"]
        reached = self._reached(name)
        self.table.update(name, status=TrialStatus.RUNNING, step=reached)
        self.console.progress(name, round=trial.get("round"), step=reached or 0, total=total)
        if reached:
            self.say(f"[{name}] resumed from its latest checkpoint (step {reached}/{total} reached before)")
        else:
            hparams = " ".join(f"{k}={fmt(v)}" for k, v in sorted(trial.get("hparams", {}).items()))
            self.say(f"[{name}] started: {total} steps, {hparams}".rstrip(", "))
        self.table.save_soon()  # and the study's index row (the table's on_save)
        if self.observers:
            self.observers.metrics.on_trial_started(trial)
        if self.mirror:
            self.mirror.trial_started(trial)

    def _reached(self, name: str) -> int | None:
        """The step a trial started again had reached: its row's, else, for a trial that ran
        before (its study's last save may predate its reports: the command was SIGKILLed), the
        last step in its metrics log."""
        row = self.table.rows.get(name, {})
        if row.get("step") or row.get("status") in (None, TrialStatus.PENDING):
            return row.get("step")
        try:
            logged = metrics_log.read(self.table.layout.trial(name).metrics_log)
        except (StorageError, *storage.storage_errors()):  # unreadable: said as started
            return None
        return logged[-1].get("step") if logged else None

    def result(self, trial: dict, result: dict) -> None:
        if result.get("summary"):
            self._summary(trial["trial_name"], result)
            return
        name, step, total = trial["trial_name"], result.get("step"), trial["max_train_steps"]
        if self.observers:
            self.observers.metrics.on_report(trial, result, self.metric)
        if self.mirror:
            self.mirror.report(name, result)
        self.table.update(name, status=TrialStatus.RUNNING, step=step, metric=result.get(self.metric))
        self.console.progress(
            name,
            round=trial.get("round"),
            step=step,
            total=total,
            metric=result.get(self.metric),
            best=result.get("best_metric"),
            steps_per_s=result.get("steps_per_s"),
        )
        if self.limiter.should_print(name, step, total):
            self.say(progress_line(name, result, total, self.metric))

    def _summary(self, name: str, result: dict) -> None:
        diverged = result.get("status") == TrialStatus.DIVERGED.reported
        status = TrialStatus.DIVERGED if diverged else TrialStatus.FINISHED
        row = self.table.update(
            name,
            status=status,
            step=result.get("last_step"),
            metric=result.get("last_metric"),  # also when this attempt evaluated nothing (resumed at the end)
            best_metric=result.get(self.metric),
            best_step=result.get("best_step"),
            best_checkpoint=result.get("best_checkpoint"),
            diverged_at_step=result.get("diverged_at_step"),
            **{k: result.get(k) for k in INPUT_ROW_FIELDS},
        )
        if status == TrialStatus.FINISHED and row.get("best_step") is not None:
            reached = result.get("reached_best_step")  # judged where its best value was first reached
            if reached is None or reached > row["best_step"]:
                reached = None
            verdict = best_step_position(name, row["best_step"], row["max_train_steps"], reached_step=reached)
            self.table.update(name, step_verdict=verdict.message if verdict.is_warning else "ok")
        at = f" at step {row.get('diverged_at_step')}" if diverged else ""
        self.say(
            f"[{name}] {status.lower()}{at}: best {self.metric}={fmt(row.get('best_metric'))} "
            f"at step {row.get('best_step')}"
        )
        self._done(name, row)

    def complete(self, trial: dict) -> None:
        self.table.save_soon()

    def error(self, trial: dict, error: str) -> None:
        name = trial["trial_name"]
        row = self.table.update(name, status=TrialStatus.FAILED, error=error)
        self.table.save_soon()
        self._done(name, row)
        self.say(f"[{name}] FAILED: {error}")

    def study_stopped(self) -> list[str]:
        """The study stopped under its running trials: they are STOPPED (a rerun resumes them),
        in the table and the MLflow mirror; their names."""
        stopped = [n for n, r in self.table.rows.items() if r.get("status") == TrialStatus.RUNNING]
        for name in stopped:
            self._done(name, self.table.update(name, status=TrialStatus.STOPPED))
        return stopped

    def _done(self, name: str, row: dict) -> None:
        self.limiter.forget(name)  # nothing per trial stays behind in the coordinator but its row
        self.console.done(name)
        if self.observers:
            self.observers.metrics.on_trial_done(name)
        if self.mirror:
            self.mirror.trial_done(name, row)
