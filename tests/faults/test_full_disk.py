"""A full disk during a checkpoint: the study's storage is a small tmpfs, filled by a ballast
file so that the trial's second checkpoint is the write that meets ENOSPC. `playbook run` ends
with one line naming the checkpoint and exit code 1, without a retry (the disk stays full); the
committed checkpoint before it still loads and nothing half-written is there; once the ballast
is gone the same command resumes from that checkpoint and ends bitwise equal to a run that
never met a full disk."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
import torch
import yaml

from service.core.errors import StorageFull
from service.distributed import checkpoint
from service.distributed.checkpoint_store import CheckpointStore
from service.study import spec
from service.study.layout import CHECKPOINT_PREFIX
from service.tracking.trial_table import TrialTable, read_rows
from tests.helpers.full_disk import CHECKPOINT_MIB, fill_leaving, fill_up, free_bytes, small_disk
from tests.helpers.playbook_process import SERVICE_ROOT
from tests.helpers.studies import TRIAL_LAYOUTS, same_nested, study_dict
from tests.helpers.trainer_runs import without_timing

pytestmark = pytest.mark.timeout(600)
TRIAL = "explore-0000"
COMPARED = ("status", "step", "metric", "best_metric", "best_step")
# Free after set-up: the step-10 checkpoint fits, the step-20 one beside it does not.
LEFT_FREE = CHECKPOINT_MIB * (1 << 20) * 3 // 2


RAY_FORWARDED = re.compile(r"^\(\w+ pid=\d+\)")
"""A line Ray forwards from one of its processes to the driver's output."""


def study_of(digits_dir, storage, layout: str) -> dict:
    return study_dict(
        digits_dir,
        storage,
        name="fulldisk",
        workload="tests.helpers.full_disk:HeavyDigits",
        training={"max_train_steps": 30, "eval_every_steps": 10, "num_checkpoints_to_keep": 1},
        rounds=[{"name": "explore", "num_trials": 1}],
        scaling=TRIAL_LAYOUTS[layout],
    )


def start_playbook_run(ray_cluster, study_file) -> subprocess.Popen:
    """`playbook run STUDY_FILE` on the shared cluster, started from the study file's folder."""
    return subprocess.Popen(
        [sys.executable, "-m", "service", "run", str(study_file)],
        cwd=os.path.dirname(study_file),
        env={
            **os.environ,
            "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address,
            "PYTHONPATH": SERVICE_ROOT,
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(run: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        out, err = run.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        run.kill()
        raise
    return subprocess.CompletedProcess(run.args, run.returncode, out, err)


def playbook_run(ray_cluster, study_file) -> subprocess.CompletedProcess:
    return finish(start_playbook_run(ray_cluster, study_file))


def checkpoints(trial_dir) -> dict[int, str]:
    """step -> folder of every checkpoint_* folder in the trial's folder."""
    names = [
        n
        for n in os.listdir(trial_dir)
        if n.startswith(CHECKPOINT_PREFIX) and n[len(CHECKPOINT_PREFIX)].isdigit()
    ]
    return {checkpoint.step_of(os.path.join(trial_dir, n)): os.path.join(trial_dir, n) for n in names}


def outcome(study: spec.Study) -> tuple[dict, list[dict], dict[int, checkpoint.TrialState]]:
    """The trial's row, its metrics log without timings, and its kept checkpoints by step."""
    (row,) = [r for r in pq.read_table(study.layout.trials_parquet).to_pylist() if r["trial_name"] == TRIAL]
    trial = study.layout.trial(TRIAL)
    with open(trial.metrics_log) as f:
        log = [without_timing(json.loads(line)) for line in f]
    kept = {step: checkpoint.load(d) for step, d in checkpoints(os.path.dirname(trial.metrics_log)).items()}
    return {k: row.get(k) for k in COMPARED}, log, kept


def plain(history: list[dict]) -> str:
    """A checkpoint's history without timings, as JSON (a NaN precision equals itself there)."""
    return json.dumps([without_timing(h) for h in history], sort_keys=True)


def test_a_save_that_meets_a_full_disk_leaves_nothing_and_names_the_checkpoint(tmp_path):
    """The store alone: the failed save's bytes are gone (the disk is as free as before it) and
    the checkpoint before it is still the latest."""
    state = checkpoint.TrialState(10, {"w": torch.zeros(1 << 18)}, {}, [], [{"step": 10}], {})  # 1 MiB
    with small_disk(tmp_path / "disk", 4) as disk:
        store = CheckpointStore(os.path.join(disk, "trial"), keep=1, metric="loss", mode="min")
        store.save(state, {"loss": 1.0})
        fill_leaving(disk, (1 << 20) // 2)
        free = free_bytes(disk)
        state.step = 20
        with pytest.raises(StorageFull) as e:
            store.save(state, {"loss": 0.5})
        assert str(e.value) == f"{store.uri(20)}: cannot write (No space left on device)"
        assert free_bytes(disk) == free and sorted(os.listdir(store.path)) == ["checkpoint_00000010"]
        assert store.latest_state().step == 10


def test_a_trial_table_write_that_meets_a_full_disk_names_the_file_and_keeps_the_last_table(tmp_path):
    """The disk filled by something else after a trial cleaned up: the coordinator's next table
    write fails in one line naming the file (not retried: a full disk stays full), the table on
    storage is the last one written, nothing half-written is left beside it, and the change is
    written by the first write after space is freed."""
    with small_disk(tmp_path / "disk", 1) as disk:
        table = TrialTable(os.path.join(disk, "study"), "validation/loss", "min")
        table.update("t-0000", status="RUNNING", step=10)
        table.save()
        ballast = fill_leaving(disk, 0)
        table.update("t-0000", status="FINISHED", step=20)
        with pytest.raises(StorageFull) as e:
            table.save()
        assert str(e.value) == f"{table.parquet_uri}: cannot write (No space left on device)"
        assert [(r["status"], r["step"]) for r in read_rows(table.study_uri)] == [("RUNNING", 10)]
        assert sorted(os.listdir(table.study_uri)) == ["trials.csv", "trials.parquet"]
        os.remove(ballast)
        table.save()
        assert [(r["status"], r["step"]) for r in read_rows(table.study_uri)] == [("FINISHED", 20)]


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster, digits_dir, tmp_path_factory):
    """The study's outcome without a full disk, by number of workers, each run once: the
    two-worker layouts share one, run on the pool, as a trial trains the same on a pool and as a
    Ray Train run (tests/ray/test_worker_pool.py)."""
    from service.orchestration.study_run import run_study

    outcomes = {}

    def of(workers: int):
        if workers not in outcomes:
            layout = "fast-path" if workers == 1 else "pool"
            reference = spec.load_dict(study_of(digits_dir, tmp_path_factory.mktemp("reference"), layout))
            run_study(reference)
            outcomes[workers] = outcome(reference)
        return outcomes[workers]

    return of


@pytest.mark.ray
@pytest.mark.parametrize("layout", TRIAL_LAYOUTS)
def test_a_full_disk_fails_the_trial_in_one_line_and_a_rerun_resumes(
    ray_cluster, digits_dir, tmp_path, layout, uninterrupted
):
    """One worker, or two on reused workers: the trial's own checkpoint store meets ENOSPC. Two
    as a Ray Train run: Ray Train's copy of rank 0's checkpoint to storage (or its controller's
    snapshot) does; it prints its worker's traceback itself (a line Ray forwards, left out
    here), and the error names the trial's folder."""
    want_row, want_log, want_kept = uninterrupted(TRIAL_LAYOUTS[layout]["workers_per_host"])

    with small_disk(tmp_path / "disk", 16) as disk:
        raw = study_of(digits_dir, os.path.join(disk, "storage"), layout)
        study_file = tmp_path / "study.yaml"
        study_file.write_text(yaml.safe_dump(raw))
        study = spec.load_dict(raw)
        trial_dir = os.path.dirname(study.layout.trial(TRIAL).metrics_log)
        ballast = fill_leaving(disk, LEFT_FREE)

        full = playbook_run(ray_cluster, study_file)
        own_store = layout != "ray-train"  # the trial's own store writes its checkpoints
        where = os.path.join(trial_dir, "checkpoint_00000020") if own_store else trial_dir
        said = f"{where}: cannot write (No space left on device)"
        assert full.returncode == 1, full.stderr
        own = [line for line in (full.stdout + full.stderr).splitlines() if not RAY_FORWARDED.match(line)]
        # nothing forwarded from a worker, where one process trains
        assert layout != "fast-path" or len(own) == len((full.stdout + full.stderr).splitlines())
        assert "Traceback" not in "\n".join(own)
        assert own[-1] == (
            f"playbook: error: trial {TRIAL}: {said}; free space and run the same command again: "
            "it resumes from the last committed checkpoints"
        ), full.stderr
        assert f"[{TRIAL}] FAILED: {said}" in full.stdout.splitlines()
        with open(os.path.join(trial_dir, "attempt.json")) as f:
            assert json.load(f)["attempt"] == 1  # not retried: the disk is as full on every try
        # Nothing half-written is there, and the committed checkpoint before it loads.
        assert not [n for n in os.listdir(trial_dir) if n.startswith(".") and n != ".validate_storage_marker"]
        assert sorted(checkpoints(trial_dir)) == [10]
        assert checkpoint.load(checkpoints(trial_dir)[10]).step == 10

        os.remove(ballast)
        rerun = playbook_run(ray_cluster, study_file)
        assert rerun.returncode == 0, rerun.stderr
        with open(os.path.join(trial_dir, "topology.json")) as f:
            assert json.load(f)["ranks"][0]["resumed_from_step"] == 10
        row, log, kept = outcome(study)
    assert row == want_row and log == want_log
    assert sorted(kept) == sorted(want_kept)
    for step, state in kept.items():
        ref = want_kept[step]
        assert same_nested(state.model, ref.model) and same_nested(state.optimizer, ref.optimizer), step
        assert same_nested(state.rng_states, ref.rng_states), step
        assert plain(state.history) == plain(ref.history), step


@pytest.mark.ray
def test_a_disk_filled_while_a_trial_trains_stops_the_study_in_one_line_and_a_rerun_finishes(
    ray_cluster, digits_dir, tmp_path
):
    """Something else fills the disk while a trial trains: whichever write meets it first (the
    trial's checkpoint or logs, or the coordinator's trial table), the study stops with one line
    naming the file and what to do, exit code 1, nothing half-written; once space is freed the
    same command resumes the trial from a committed checkpoint and finishes it."""
    raw = study_dict(
        digits_dir,
        os.path.join(tmp_path, "disk", "storage"),
        name="filled",
        training={"max_train_steps": 3000, "eval_every_steps": 100, "num_checkpoints_to_keep": 1},
        rounds=[{"name": "explore", "num_trials": 1}],
    )
    study_file = tmp_path / "study.yaml"
    study_file.write_text(yaml.safe_dump(raw))
    trial_dir = os.path.dirname(spec.load_dict(raw).layout.trial(TRIAL).metrics_log)
    with small_disk(tmp_path / "disk", 16) as disk:
        run = start_playbook_run(ray_cluster, study_file)
        while run.poll() is None and not [
            s for s in (checkpoints(trial_dir) if os.path.isdir(trial_dir) else {}) if s >= 200
        ]:
            time.sleep(0.05)
        ballast = fill_up(disk)
        filled = finish(run)
        assert filled.returncode == 1, filled.stderr
        own = [line for line in (filled.stdout + filled.stderr).splitlines() if not RAY_FORWARDED.match(line)]
        assert "Traceback" not in "\n".join(own)
        said = re.fullmatch(
            r"playbook: error: (trial explore-0000: )?(\S+): cannot write \(No space left on device\); "
            r"free space and run the same command again: it resumes from the last committed checkpoints",
            own[-1],
        )
        assert said and said.group(2).startswith(os.path.join(disk, "storage")), own[-1]
        assert not [n for n in os.listdir(trial_dir) if n.startswith(".") and n != ".validate_storage_marker"]
        os.remove(ballast)
        rerun = playbook_run(ray_cluster, study_file)
        assert rerun.returncode == 0, rerun.stderr
        with open(os.path.join(trial_dir, "topology.json")) as f:
            assert json.load(f)["ranks"][0]["resumed_from_step"] >= 200
        (row,) = pq.read_table(spec.load_dict(raw).layout.trials_parquet).to_pylist()
        assert (row["status"], row["step"]) == ("FINISHED", 3000)
