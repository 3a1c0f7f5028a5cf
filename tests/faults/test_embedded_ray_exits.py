"""How `playbook run` on an embedded Ray (no RAY_ADDRESS) ends when something is killed under it,
from the command's side: its coordinator SIGKILLed ends the run with one line naming what died
and that a rerun resumes (exit 1, no traceback), and the rerun finishes the study; the command
itself SIGKILLed, SIGTERMed or interrupted leaves none of its Ray's processes (the raylet's
DashboardAgent and RuntimeEnvAgent among them) alive 20 s later, nor its watcher
(`service/cli/reaper.py`). Each run's processes are found by its own session, never by name."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
import yaml

from tests.helpers.playbook_process import (
    SERVICE_ROOT,
    output,
    start_run,
    titles,
    wait_for_title,
    watchers_of,
)
from tests.helpers.processes import end_session, kill_session, own_lines, session_pids
from tests.helpers.studies import study_dict

pytestmark = [pytest.mark.timeout(600)]
GONE_WITHIN_S = 20
RAY_LOG = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+(INFO|WARNING) ")  # ray.init's own log records


def write_study(digits_dir, folder, steps: int, eval_every: int | None = None) -> str:
    raw = study_dict(
        digits_dir,
        folder / "storage",
        name="embedded",
        training={
            "max_train_steps": steps,
            "eval_every_steps": eval_every or steps // 4,
            "schedule": {"kind": "constant"},
        },
        rounds=[{"name": "explore", "num_trials": 1}],
    )
    path = folder / "study.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def command_lines(err: str) -> list[str]:
    """The command's own stderr lines: not those Ray forwards from its processes, nor the
    INFO and WARNING records of starting an embedded Ray."""
    return [line for line in own_lines(err) if not RAY_LOG.match(line)]


def test_a_killed_coordinator_ends_the_run_in_one_line_and_a_rerun_finishes(digits_dir, tmp_path):
    study_file = write_study(digits_dir, tmp_path, steps=800)
    proc = start_run(study_file, tmp_path)
    try:
        wait_for_title(proc, "ray::ImplicitFunc")  # the trial is training
        coordinator = wait_for_title(proc, "ray::Coordinator")
        os.kill(coordinator, signal.SIGKILL)
        assert proc.wait(timeout=120) == 1
    finally:
        kill_session(proc.pid)
        end_session(proc)
    out, err = output(tmp_path)
    assert "Traceback" not in out + err
    (line,) = command_lines(err)
    assert line.startswith(
        f"playbook: error: the study's coordinator (Ray actor study-embedded, pid {coordinator}) died"
    )
    assert line.endswith("run the same command again to resume the study")

    rerun = start_run(study_file, tmp_path)
    try:
        assert rerun.wait(timeout=400) == 0, output(tmp_path)
    finally:
        end_session(rerun)
    (row,) = pq.read_table(tmp_path / "storage" / "embedded" / "trials.parquet").to_pylist()
    assert (row["status"], row["step"]) == ("FINISHED", 800)


STOPPED = {
    signal.SIGTERM: ("stopped by SIGTERM", 143),
    signal.SIGINT: ("interrupted", 130),
}
"""What `playbook run` says and exits with, stopped by a signal it can handle."""


def logged_steps(folder) -> list[int]:
    """The steps the study's one trial has evaluated at (its metrics log)."""
    with contextlib.suppress(OSError):
        with open(folder / "storage" / "embedded" / "trials" / "explore-0000" / "metrics.jsonl") as f:
            return [json.loads(line)["step"] for line in f if line.strip()]
    return []


def stored_row(folder) -> dict:
    """The study's one trial row as stored (empty while there is none)."""
    with contextlib.suppress(OSError, ValueError):
        (row,) = pq.read_table(folder / "storage" / "embedded" / "trials.parquet").to_pylist()
        return row
    return {}


def stored_status(folder) -> str:
    """What `playbook status STUDY_FILE` prints with no Ray to ask (from storage)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "-m", "service", "status", str(folder / "study.yaml")],
        cwd=folder,
        env={**env, "PYTHONPATH": SERVICE_ROOT},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_killed_run_leaves_none_of_its_ray_processes(digits_dir, tmp_path, sig):
    """Also: SIGTERM and SIGINT end it in one line that says how to resume, after the study's
    state is saved: the trial's row with the step it had reached, the study `stopped` in the
    storage root's table."""
    # Far more steps than it trains before the signal, whatever this machine's speed (3,000 steps
    # were done in 5 s once, before the signal came).
    proc = start_run(write_study(digits_dir, tmp_path, steps=10**6, eval_every=500), tmp_path)
    try:
        wait_for_title(proc, "ray::ImplicitFunc")
        if sig in STOPPED:  # a report has reached the coordinator: its step is what it saves
            deadline = time.time() + 120
            while len(logged_steps(tmp_path)) < 2 and time.time() < deadline:
                time.sleep(0.2)
            assert len(logged_steps(tmp_path)) >= 2, "the trial never evaluated twice"
        agents = [
            t
            for t in titles(proc.pid).values()
            if t.startswith(("ray::DashboardAgent", "ray::RuntimeEnvAgent"))
        ]
        assert len(agents) == 2, titles(proc.pid)  # what outlived a SIGKILLed run
        os.kill(proc.pid, sig)
        code = proc.wait(timeout=60)
        deadline = time.time() + GONE_WITHIN_S
        while (session_pids(proc.pid) or watchers_of(proc.pid)) and time.time() < deadline:
            time.sleep(0.5)
        left = titles(proc.pid)
        assert not left, f"alive {GONE_WITHIN_S} s after {sig.name}: {left}"
        assert not watchers_of(proc.pid)
        if sig in STOPPED:
            how, want_code = STOPPED[sig]
            out, err = output(tmp_path)
            assert "Traceback" not in out + err and "***" not in err, err[-3000:]
            assert (code, command_lines(err)) == (
                want_code,
                [
                    f"playbook: {how}; finished trials and checkpoints are kept in "
                    f"{tmp_path / 'storage' / 'embedded'}: run the same command again to resume the study"
                ],
            )
            (study,) = pq.read_table(tmp_path / "storage" / "studies.parquet").to_pylist()
            row = stored_row(tmp_path)
            assert study["state"] == "stopped" and row["status"] == "STOPPED"
            assert row["step"] in logged_steps(tmp_path)  # where it was: a rerun says it resumes there
            status = stored_status(tmp_path)
            assert f"study embedded: stopped; stored at {tmp_path / 'storage' / 'embedded'}" in status
            assert re.search(rf"^explore-0000 +STOPPED +{row['step']} ", status, re.M), status
    finally:
        kill_session(proc.pid)
        for pid in watchers_of(proc.pid):
            os.kill(pid, signal.SIGKILL)
