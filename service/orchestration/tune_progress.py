"""Tune's trial events to the study's coordinator, from the process that runs a Tune run
(`tune_run.TuneRun`)."""

from __future__ import annotations

import ray
from ray import tune

from service.core import storage
from service.core.trial_status import TrialStatus
from service.study.layout import StudyLayout


class ProgressCallback(tune.Callback):
    """Sends Tune's trial events to the coordinator. Holds only its handle and the study's
    layout: Tune pickles its callbacks with the experiment state."""

    def __init__(self, coordinator, layout: StudyLayout):
        self.coordinator, self.layout = coordinator, layout

    def _send(self, kind: str, trial, *args) -> None:
        ray.get(self.coordinator.trial_event.remote(kind, trial.config["trial"], *args))

    def on_trial_start(self, iteration, trials, trial, **info):
        self._send("started", trial)

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if result.get("summary") and result.get("status") == TrialStatus.FAILED.reported:
            # A final error: the trial function ended it without a retry (`launch.tune_trial`),
            # its message already in the trial's error.txt; full storage stops the study too.
            self._send("stopped" if result.get("stops_study") else "error", trial, result["error"])
            return
        self._send("result", trial, {k: v for k, v in result.items() if k != "config"})

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._send("complete", trial)

    def on_trial_error(self, iteration, trials, trial, **info):
        """A trial that failed after Tune's retries: its error's last line to the trial row,
        the whole of Tune's error file (every attempt's traceback, in Ray's session folder on
        this node) to the trial's error.txt in the study's storage."""
        text = ""
        if trial.error_file:
            try:
                with open(trial.error_file) as f:
                    text = f.read()
            except OSError:
                pass
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if not lines:
            self._send("error", trial, "failed (no error recorded)")
            return
        uri = self.layout.trial(trial.config["trial"]["trial_name"]).error_file
        storage.write_bytes_atomic(uri, text.encode())
        self._send("error", trial, f"{lines[-1]} (all of it: {uri})")
