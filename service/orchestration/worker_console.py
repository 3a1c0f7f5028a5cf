"""What a Ray Train or Tune worker process prints: Ray's per-report INFO lines and the warnings
that are not the user's to act on go to Ray's log files, not the job log; Tune's own output is
not printed; a SIGTERM at the end of a run prints no traceback. `playbook run --verbose` sets
VERBOSE_ENV in every process of its job, which brings Tune's output back."""

from __future__ import annotations

import logging
import os
import sys
import warnings

VERBOSE_ENV = "PLAYBOOK_VERBOSE"


def verbose() -> bool:
    """Whether this process belongs to a `playbook run --verbose` job."""
    return os.environ.get(VERBOSE_ENV) == "1"


def quiet_tune() -> None:
    """Call in the process that runs a Tune run, before it starts. Tune's output engine prints
    a configuration box, "View detailed results here" and blank lines at any verbosity; its
    legacy engine at verbose=0 prints nothing. Tune's INFO records ("Wrote the latest version of
    all result files ...") are dropped; its warnings and errors are shown. The study's own lines
    say what happens (`tracking.trial_events`). Unless `verbose()`."""
    if verbose():
        return
    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    logging.getLogger("ray.tune").setLevel(logging.WARNING)


NOT_THE_USERS_PROBLEM = ("`broadcast_buffers` is deprecated",)
"""Starts of Python warnings a Train worker sends to Ray Train's log file instead of the job
log: torch's notice about the DDP argument the loop passes on purpose (see `trainer.loop`)."""


def quiet_train_console() -> None:
    """Ray Train's workers log every report at INFO on the console, which floods the job log
    (the run's LoggingConfig does not reach the worker console in 2.60). Raise the console
    handler to WARNING; Ray's log files keep everything."""
    for handler in logging.getLogger("ray.train").handlers:
        if type(handler).__name__ == "PlainRayHandler":
            handler.setLevel(logging.WARNING)


def log_known_warnings() -> None:
    """Warnings of `NOT_THE_USERS_PROBLEM` go to Ray Train's log file in a Ray Train worker
    (INFO: below what its console handler shows, see `quiet_train_console`) and nowhere in
    another process (a Tune trial, a pool worker: Ray's console handler there shows INFO, and
    the process has no log file but its console); every other warning is shown as usual.
    Once per process."""
    if getattr(warnings.showwarning, "playbook", False):
        return
    show = warnings.showwarning
    log = logging.getLogger("ray.train.playbook")
    log.propagate = bool(logging.getLogger("ray.train").handlers)  # Ray Train's own handlers

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if str(message).startswith(NOT_THE_USERS_PROBLEM):
            log.info("%s:%s: %s: %s", filename, lineno, category.__name__, message)
        else:
            show(message, category, filename, lineno, file, line)

    showwarning.playbook = True
    warnings.showwarning = showwarning


def quiet_exit_on_sigterm() -> None:
    """Ray ends a trial's processes with SIGTERM (a Tune run's actors at its end), and its
    handler raises SystemExit. Landing inside a weakref callback or `__del__`, that SystemExit
    cannot propagate: Python prints it as `Exception ignored ... SystemExit: 1`, which the job
    log shows as a traceback of a run that succeeded. Such a SystemExit goes to Ray's log file
    instead; every other unraisable exception is printed as usual."""
    if getattr(sys.unraisablehook, "playbook", False):
        return
    log = logging.getLogger("ray.tune.playbook")

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, SystemExit):
            log.debug("SystemExit(%s) at process exit in %r", unraisable.exc_value.code, unraisable.object)
        else:
            sys.__unraisablehook__(unraisable)

    hook.playbook = True
    sys.unraisablehook = hook
