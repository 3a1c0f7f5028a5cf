"""The driver's side of a study: start its coordinator (`coordinator.Coordinator`) on the
connected cluster, show what it says while it runs, and turn how it ended (finished, bad input,
stopped by its user, its coordinator lost) into a result or one line."""

from __future__ import annotations

import re

import ray

from service.core import stop_signal
from service.core.errors import PlaybookError, RunStopped, StudyInterrupted
from service.orchestration.actor_options import cluster_env, on_this_node
from service.orchestration.coordinator import NAMESPACE, Coordinator, actor_name
from service.study.spec import Study
from service.tracking.console import PlainLines

# How often the command that started a study fetches and prints the coordinator's new lines.
CONSOLE_POLL_S = 0.5
STOP_SAVE_S = 15


def run_study(study: Study, view=None, settle_metrics: bool = False) -> list[dict]:
    """Start the study's coordinator on the connected Ray cluster and wait for it, showing what
    it says to its user on `view` as it goes (`cli.live_table`: `say(line)`, `running(trials)`;
    default: the lines printed). `settle_metrics`: the coordinator stays until its last metric
    values are exported (a cluster that Prometheus scrapes outlives the study)."""
    check_not_running(study)
    name = actor_name(study.name)
    coordinator = Coordinator.options(
        name=name,
        namespace=NAMESPACE,
        runtime_env={"env_vars": cluster_env()},
        scheduling_strategy=on_this_node(),
    ).remote(study)
    try:
        rows = follow(coordinator, coordinator.run.remote(), view or PlainLines())
        if settle_metrics:
            ray.get(coordinator.settle_metrics.remote())
        return rows
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, PlaybookError):  # bad input: its one line, not Ray's traceback
            raise e.cause from None
        raise
    except ray.exceptions.RayActorError as e:
        if e.actor_init_failed:
            raise
        raise coordinator_died(study, name, e) from None
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (`core.stop_signal`)
        raise stopped(study, coordinator) from None
    finally:
        ray.kill(coordinator)


def check_not_running(study: Study) -> None:
    """Refuse a study whose coordinator runs on the connected cluster (a second run would mix
    with it)."""
    try:
        ray.get_actor(actor_name(study.name), namespace=NAMESPACE)
    except ValueError:
        return
    raise PlaybookError(f"study {study.name!r} is already running on this cluster")


def stopped(study: Study, coordinator) -> RunStopped:
    """The command was stopped (Ctrl-C, SIGTERM): the coordinator saves the study's state as
    it is, if it still can within STOP_SAVE_S; the one line that says so."""
    try:
        ray.get(coordinator.stop.remote(), timeout=STOP_SAVE_S)
    except Exception:  # its Ray went down with the signal (Ctrl-C reaches the whole terminal)
        pass
    how, code = ("stopped by SIGTERM", 143) if stop_signal.by_sigterm() else ("interrupted", 130)
    return RunStopped(
        f"{how}; finished trials and checkpoints are kept in {study.study_uri}: run the same command "
        "again to resume the study",
        code,
    )


def follow(coordinator, done: ray.ObjectRef, view) -> list[dict]:
    """Wait for the coordinator's `run` (`done`), showing its lines and running trials on
    `view` every CONSOLE_POLL_S and once more at the end: the lines of a run that failed are
    all shown too."""
    number = 0
    while True:
        finished = bool(ray.wait([done], timeout=CONSOLE_POLL_S)[0])
        try:
            number, lines, running = ray.get(coordinator.console_lines.remote(number))
        except ray.exceptions.RayActorError:  # it died: `done` says how
            lines, running = [], {}
        view.running({} if finished else running)  # the lines below are shown under it
        for line in lines:
            view.say(line)
        if finished:
            return ray.get(done)


def coordinator_died(study: Study, name: str, error: Exception) -> StudyInterrupted:
    """The one line for a coordinator that died under the study (its process killed, its node
    lost): what died, and that a rerun resumes."""
    pid = re.search(r"\bpid: (\d+)", str(error))
    return StudyInterrupted(
        f"the study's coordinator (Ray actor {name}{f', pid {pid.group(1)}' if pid else ''}) died; "
        f"finished trials and checkpoints are kept in {study.study_uri}: run the same command again "
        "to resume the study"
    )


def live_status(study_name: str) -> dict | None:
    """Ask the running coordinator, if there is one on the connected cluster."""
    try:
        actor = ray.get_actor(actor_name(study_name), namespace=NAMESPACE)
    except ValueError:
        return None
    return ray.get(actor.status.remote(), timeout=30)
