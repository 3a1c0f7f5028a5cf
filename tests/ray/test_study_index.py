"""The storage root's study table: a study's row from its trial rows and provenance, and two
processes recording studies into one root at the same time lose no rows (local disk, and gs://
through gcsfs against gcp-storage-emulator on loopback), nor do two real studies run at once from
one driver, each running only its own trials."""

from __future__ import annotations

import csv
import json
import os
import shlex
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest

from service.core import storage
from service.orchestration.study_metrics import StudyMetrics
from service.tracking import study_index
from tests.helpers.gcs import emulator_command
from tests.helpers.processes import free_ports

WRITER = """
import sys, time
from service.tracking import study_index
root, prefix, n, start_file = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
import os
while not os.path.exists(start_file):  # both writers start together
    time.sleep(0.01)
for i in range(n):
    rows = [{"trial_name": f"t{j}", "status": "FINISHED", "best_metric": float(j)} for j in range(i % 3 + 1)]
    row = study_index.study_row(f"{prefix}{i:03d}", f"{root}/{prefix}{i:03d}", "d", "validation/loss",
                                "min", rows, None, "running")
    study_index.record(root, row)
    # and rewrite an earlier study's row, as a running study does after every trial
    study_index.record(root, {**row, "study": f"{prefix}{i // 2:03d}", "state": "finished"})
"""


def test_row_counts_best_and_provenance():
    rows = [
        {
            "trial_name": "a",
            "status": "FINISHED",
            "best_metric": 0.3,
            "best_step": 20,
            "best_checkpoint": "c1",
        },
        {
            "trial_name": "b",
            "status": "FINISHED",
            "best_metric": 0.1,
            "best_step": 40,
            "best_checkpoint": "c2",
        },
        {"trial_name": "c", "status": "DIVERGED", "best_metric": None},
        {"trial_name": "d", "status": "FAILED"},
        {"trial_name": "e", "status": "RUNNING", "best_metric": 0.01},  # not a result yet
    ]
    prov = {"git_commit": "abc", "git_dirty": True, "uncommitted_diff": "/s/x/uncommitted.diff"}
    prov["reproduce"] = ["/usr/bin/python", "-m", "service", "run", "/s/my study/study.yaml"]
    row = study_index.study_row("x", "/s/x", "why", "validation/loss", "min", rows, prov, "finished")
    assert (row["trials"], row["trials_finished"], row["trials_diverged"], row["trials_failed"]) == (
        5,
        2,
        1,
        1,
    )
    assert (row["best_trial"], row["best_metric"], row["best_step"], row["best_checkpoint"]) == (
        "b",
        0.1,
        40,
        "c2",
    )
    assert row["study_file"] == "/s/x/study.yaml"
    assert shlex.split(row["reproduce"]) == prov["reproduce"]  # quoted: the space survives
    assert row["git_commit"] == "abc" and row["uncommitted_diff"] == "/s/x/uncommitted.diff"
    maximise = study_index.study_row("x", "/s/x", "", "validation/accuracy", "max", rows, None, "running")
    assert maximise["best_trial"] == "a" and maximise["git_commit"] is None


def record_concurrently(root: str, start: str, n: int, env: dict | None = None) -> set[str]:
    """Two writer processes, started together, record n studies each; returns the names."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, root, prefix, str(n), start], cwd=os.getcwd(), env=env
        )
        for prefix in ("alpha-", "beta-")
    ]
    time.sleep(1.0)  # let both interpreters import and wait at the start line
    open(start, "w").close()
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    return {f"{p}{i:03d}" for p in ("alpha-", "beta-") for i in range(n)}


def test_two_processes_recording_at_once_lose_no_rows(tmp_path):
    root, n = str(tmp_path / "root"), 25
    expected = record_concurrently(root, str(tmp_path / "start"), n)
    # The table files as the writers left them (not recompiled by this test) hold every study.
    table = pq.read_table(os.path.join(root, "studies.parquet")).to_pylist()
    assert sorted(r["study"] for r in table) == sorted(expected)
    with open(os.path.join(root, "studies.csv")) as f:
        assert sorted(r["study"] for r in csv.DictReader(f)) == sorted(expected)
    # Each study's row is its last write: studies rewritten as "finished" are finished.
    finished = {f"{p}{i // 2:03d}" for p in ("alpha-", "beta-") for i in range(n)}
    assert {r["study"] for r in table if r["state"] == "finished"} == finished
    assert sorted(r["study"] for r in study_index.read_index(root)) == sorted(expected)


@pytest.fixture
def gcs_emulator(monkeypatch):
    (port,) = free_ports(1)
    proc = subprocess.Popen(
        emulator_command(
            "start", "--host=127.0.0.1", f"--port={port}", "--in-memory", "--default-bucket=bkt"
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            storage.write_bytes_atomic("gs://bkt/probe", b"x")
            break
        except Exception:
            time.sleep(0.3)
    yield {**os.environ, **env}
    proc.terminate()
    proc.wait(timeout=30)


def test_two_processes_on_gcs_lose_no_rows(gcs_emulator, tmp_path):
    import io

    root = "gs://bkt/studies"
    expected = record_concurrently(root, str(tmp_path / "start"), 10, env=gcs_emulator)
    table = pq.read_table(io.BytesIO(storage.read_bytes(root + "/studies.parquet"))).to_pylist()
    assert sorted(r["study"] for r in table) == sorted(expected)


@pytest.mark.ray
def test_two_real_studies_at_once_from_one_driver(ray_cluster, digits_dir, tmp_path):
    """Two `run_study` coordinators started from one driver (one Ray job, one Tune trainable
    registry), one storage root. "left" runs its trials one at a time and "right" starts once
    left's first trial runs, so left's later trials start after right's Tuner registered its
    trainable: each study's trials must still run with their own study (its storage, its round
    names). The root's table (read from its files) has both studies, each with the trial count
    and best metric of its own trial table."""
    import threading

    from service.orchestration.study_run import run_study
    from service.study import spec
    from tests.helpers.studies import study_dict

    root = tmp_path / "root"
    steps = {"max_train_steps": 60, "eval_every_steps": 30}
    left = spec.load_dict(
        study_dict(
            digits_dir,
            root,
            name="left",
            training=steps,
            rounds=[{"name": "explore", "num_trials": 3, "max_concurrent_trials": 1}],
        )
    )
    right = spec.load_dict(
        study_dict(digits_dir, root, name="right", training=steps, rounds=[{"name": "wide", "num_trials": 2}])
    )
    errors = []

    def run(study):
        try:
            run_study(study)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s,)) for s in (left, right)]
    threads[0].start()
    first_metrics = os.path.join(left.study_uri, "trials", "explore-0000", "metrics.jsonl")
    deadline = time.time() + 300
    while not os.path.exists(first_metrics) and time.time() < deadline and threads[0].is_alive():
        time.sleep(0.2)
    threads[1].start()
    for t in threads:
        t.join(timeout=600)
    assert not errors and not any(t.is_alive() for t in threads), errors

    table = {r["study"]: r for r in pq.read_table(str(root / "studies.parquet")).to_pylist()}
    assert sorted(table) == ["left", "right"]
    for study, prefix, n in ((left, "explore", 3), (right, "wide", 2)):
        trials = pq.read_table(os.path.join(study.study_uri, "trials.parquet")).to_pylist()
        names = sorted(t["trial_name"] for t in trials)
        assert names == [f"{prefix}-{i:04d}" for i in range(n)]
        # every trial trained into its own study's folder, and nothing else did
        assert sorted(os.listdir(os.path.join(study.study_uri, "trials"))) == names
        for name in names:
            log = os.path.join(study.study_uri, "trials", name, "metrics.jsonl")
            assert [json.loads(x)["step"] for x in open(log)][-1] == 60
        row = table[study.name]
        assert row["trials"] == n and row["trials_finished"] == n
        assert row["best_metric"] == min(t["best_metric"] for t in trials)
        assert row["state"] == "finished"


def test_a_running_study_writes_its_own_row_each_time_and_compiles_the_root_coalesced(
    tmp_path, digits_dir, monkeypatch
):
    """A study's trial-table changes each write its own index object (one PUT), but the root's
    table -- whose compile reads every study's object, O(studies in the root) -- is compiled at
    most every COMPILE_MIN_INTERVAL_S while it runs, and at once when it ends."""
    from service.tracking import observe
    from tests.helpers.studies import make_study

    root = tmp_path / "root"
    for i in range(40):  # other studies in the same root
        storage.write_json(study_index.index_uri(str(root), f"other-{i:02d}"), {"study": f"other-{i:02d}"})
    study = make_study(digits_dir, root, name="mine")
    audit = tmp_path / "audit"
    audit.mkdir()
    monkeypatch.setenv(storage.AUDIT_ENV, str(audit))
    observers = observe.StudyObservers.for_study(study, StudyMetrics(study.name, study.training.mode))
    rows = []
    for i in range(30):
        rows.append({"trial_name": f"t{i}", "status": "FINISHED", "best_metric": 1.0 / (i + 1)})
        observers.rows_changed(list(rows))
        own = json.loads(storage.read_bytes(study_index.index_uri(str(root), "mine")))
        assert (own["trials"], own["best_trial"], own["state"]) == (i + 1, f"t{i}", "running")
    written = [line.strip() for f in audit.iterdir() for line in open(f)]
    assert written.count(str(root / "studies.parquet")) == 1  # the first change; the rest waits
    table = {r["study"]: r for r in pq.read_table(root / "studies.parquet").to_pylist()}
    assert len(table) == 41 and table["mine"]["trials"] == 1

    observers.rows_changed(list(rows), state="finished")
    table = {r["study"]: r for r in pq.read_table(root / "studies.parquet").to_pylist()}
    assert len(table) == 41
    mine = table["mine"]
    assert (mine["trials"], mine["state"], mine["best_trial"]) == (30, "finished", "t29")
    observers.metrics.stop()


def test_a_root_whose_path_has_glob_characters_is_read_literally(tmp_path):
    root = str(tmp_path / "team[1]*")
    for name in ("a", "b"):
        study_index.record(root, {"study": name, "state": "running"})
    assert [r["study"] for r in study_index.read_index(root)] == ["a", "b"]
    table = pq.read_table(os.path.join(root, "studies.parquet")).to_pylist()
    assert [r["study"] for r in table] == ["a", "b"]
