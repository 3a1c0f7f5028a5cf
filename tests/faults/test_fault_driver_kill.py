"""The driver (`playbook run`, which holds the coordinator) SIGKILLed mid-study, then the same
command rerun: finished trials are not rerun, the one cut off resumes from its checkpoint, no
trial row is lost or doubled, a NaN trial ends DIVERGED while the study goes on, and every
result is bitwise the uninterrupted run's. The same guarantees when the process running the
round's Tune run (`TuneRun`) is SIGKILLed instead: the coordinator starts the run again by
itself. Also: a torn latest checkpoint on Ray's storage is skipped on resume."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pyarrow.parquet as pq
import pytest
import torch
import yaml

from service.distributed import checkpoint
from service.planning.trial import TrialPlan
from service.study import spec
from service.trainer.loop import TIMING_FIELDS
from tests.helpers.processes import end_session, kill_session
from tests.helpers.studies import free_cpus_after_study, same_nested, study_dict

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]
STEPS, EVERY = 3000, 500  # long enough (seconds, on the fast path) to kill the last trial mid-run
LEARNING_RATES = [0.05, 1e30, 0.1]  # explore-0001 diverges; explore-0002 runs after it
TRIALS = [f"explore-{i:04d}" for i in range(len(LEARNING_RATES))]
DROP = TIMING_FIELDS


def study_raw(digits_dir, storage) -> dict:
    return study_dict(
        digits_dir,
        storage,
        name="driverkill",
        training={"max_train_steps": STEPS, "eval_every_steps": EVERY, "schedule": {"kind": "constant"}},
        search={
            "learning_rate": {"role": "nuisance", "type": "choice", "values": LEARNING_RATES},
            "momentum": {"role": "fixed", "value": 0.9},
            "width": {"role": "fixed", "value": 4},
        },
        rounds=[{"name": "explore", "kind": "grid", "num_trials": 3, "max_concurrent_trials": 1}],
    )


@pytest.fixture(scope="module")
def baseline(ray_cluster, digits_dir, tmp_path_factory):
    """The same study, uninterrupted, on the session cluster."""
    from service.orchestration.study_run import run_study

    study = spec.load_dict(study_raw(digits_dir, tmp_path_factory.mktemp("baseline")))
    t0 = time.time()
    run_study(study)
    print(f"timing: baseline study {time.time() - t0:.0f}s")
    return study


def trial_dir(study_uri, name) -> str:
    return os.path.join(study_uri, "trials", name)


def read_log(study_uri, name) -> list[dict]:
    path = os.path.join(trial_dir(study_uri, name), "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in DROP} for line in f if line.strip()]


def registered_steps(study_uri, name) -> list[int]:
    """Steps a restarted trial can resume from: the committed checkpoints on storage (the
    single-worker fast path resumes from those; a Ray Train run from those its controller
    registered, listed in its snapshot)."""
    try:
        with open(os.path.join(trial_dir(study_uri, name), "checkpoint_manager_snapshot.json")) as f:
            return [r["metrics"]["step"] for r in json.load(f)["checkpoint_results"]]
    except (OSError, ValueError, KeyError):
        pass
    try:
        return sorted(committed(study_uri, name))
    except OSError:
        return []


def stored_rows(study_uri) -> list[dict]:
    try:
        return pq.read_table(os.path.join(study_uri, "trials.parquet")).to_pylist()
    except (OSError, ValueError):
        return []


def committed(study_uri, name) -> dict[int, str]:
    d = trial_dir(study_uri, name)
    dirs = [os.path.join(d, c) for c in os.listdir(d) if c.startswith("checkpoint_")]
    return {checkpoint.step_of(c): c for c in dirs if checkpoint.is_complete(c)}


def playbook_run(study_file, cwd) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.Popen(
        [sys.executable, "-m", "service", "run", str(study_file)],
        cwd=cwd,
        env={**env, "PYTHONPATH": os.getcwd()},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the embedded Ray it starts lives in this session, ended below
    )


@pytest.fixture(scope="module")
def killed_and_rerun(baseline, digits_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("killed")
    study_file = tmp / "study.yaml"
    study_file.write_text(yaml.safe_dump(study_raw(digits_dir, tmp / "storage")))
    study_uri = str(tmp / "storage" / "driverkill")
    last = TRIALS[-1]

    t0 = time.time()
    proc = playbook_run(study_file, tmp)
    at_kill = None
    deadline = time.time() + 400
    while proc.poll() is None and time.time() < deadline:
        done = {r["trial_name"]: r["status"] for r in stored_rows(study_uri)}
        # Kill once the first two trials are over and the last one has a checkpoint that Ray's
        # controller registered (see test_fault_worker_kill.py: an unregistered one is lost).
        if (
            done.get(TRIALS[0]) == "FINISHED"
            and done.get(TRIALS[1]) == "DIVERGED"
            and registered_steps(study_uri, last)
        ):
            log = read_log(study_uri, last)
            os.kill(proc.pid, signal.SIGKILL)
            # Its embedded Ray goes with it at once, as when the driver's machine is lost: left
            # to wind down on its own, the orphaned trial could train to its end first, and the
            # rerun would then have nothing to resume.
            kill_session(proc.pid)
            at_kill = {
                "registered": registered_steps(study_uri, last),
                "logged": log[-1]["step"] if log else 0,
                "rows": stored_rows(study_uri),
                "topology": {
                    t: open(os.path.join(trial_dir(study_uri, t), "topology.json")).read() for t in TRIALS[:2]
                },
                "logs": {t: read_log(study_uri, t) for t in TRIALS[:2]},
            }
            break
        time.sleep(0.1)
    first_out = proc.communicate(timeout=60)[0]
    end_session(proc)
    assert at_kill is not None, f"the driver was never killed mid-study:\n{first_out[-3000:]}"

    print(f"timing: run until killed {time.time() - t0:.0f}s")
    t0 = time.time()
    rerun = playbook_run(study_file, tmp)
    out = rerun.communicate(timeout=600)[0]
    end_session(rerun)
    print(f"timing: rerun {time.time() - t0:.0f}s")
    return study_uri, at_kill, rerun.returncode, out


def test_the_driver_was_killed_mid_trial(killed_and_rerun):
    _, at_kill, _, _ = killed_and_rerun
    assert at_kill["logged"] < STEPS
    assert {r["trial_name"]: r["status"] for r in at_kill["rows"]}[TRIALS[-1]] in ("RUNNING", "PENDING")


def test_rerun_finishes_without_rerunning_finished_trials(killed_and_rerun):
    study_uri, at_kill, rc, out = killed_and_rerun
    assert rc == 0, out[-3000:]  # a diverged trial is a result, not a failure
    assert "round explore: resuming from" in out
    for name in TRIALS[:2]:  # not started again: topology.json is rewritten by every start
        with open(os.path.join(trial_dir(study_uri, name), "topology.json")) as f:
            assert f.read() == at_kill["topology"][name], name
        assert read_log(study_uri, name) == at_kill["logs"][name]
    with open(os.path.join(trial_dir(study_uri, TRIALS[-1]), "topology.json")) as f:
        resumed = json.load(f)["ranks"][0]["resumed_from_step"]
    # From a checkpoint at least as late as one committed when the driver died; the trial's own
    # process may commit later ones before it notices its driver is gone, and those are whole.
    assert max(at_kill["registered"]) <= resumed < STEPS and resumed % EVERY == 0


def test_rows_are_neither_lost_nor_doubled_and_match_the_uninterrupted_run(killed_and_rerun, baseline):
    study_uri, _, _, _ = killed_and_rerun
    rows = stored_rows(study_uri)
    assert sorted(r["trial_name"] for r in rows) == TRIALS  # each exactly once
    want = {r["trial_name"]: r for r in stored_rows(baseline.study_uri)}
    assert [want[t]["status"] for t in TRIALS] == ["FINISHED", "DIVERGED", "FINISHED"]
    for row in rows:
        ref = want[row["trial_name"]]
        for key in ("status", "step", "best_metric", "best_step", "diverged_at_step", "hp/learning_rate"):
            assert row.get(key) == ref.get(key), (row["trial_name"], key)
        if row["best_checkpoint"] or ref["best_checkpoint"]:
            assert checkpoint.step_of(row["best_checkpoint"]) == checkpoint.step_of(ref["best_checkpoint"])


def test_logs_and_weights_are_bitwise_the_uninterrupted_runs(killed_and_rerun, baseline):
    study_uri, _, _, _ = killed_and_rerun
    for name in TRIALS:
        assert read_log(study_uri, name) == read_log(baseline.study_uri, name), name
    for name in (TRIALS[0], TRIALS[2]):
        got, want = committed(study_uri, name), committed(baseline.study_uri, name)
        assert sorted(got) == sorted(want)  # the same best-N + latest checkpoints kept
        a, b = checkpoint.load(got[STEPS]), checkpoint.load(want[STEPS])
        for key in b.model:
            assert torch.equal(a.model[key], b.model[key]), (name, key)
        assert same_nested(a.rng_states, b.rng_states)


def alive_actor_pids(class_name: str) -> list[int]:
    import ray

    return [
        a["Pid"]
        for a in ray._private.state.actors().values()
        if a["ActorClassName"] == class_name and a["State"] == "ALIVE" and a["Pid"]
    ]


@pytest.fixture(scope="module")
def tune_run_killed(baseline, digits_dir, tmp_path_factory):
    """The study on the session cluster; its TuneRun process SIGKILLed at the moment the driver
    is killed above (the first two trials over, the last one mid-run with a checkpoint)."""
    from service.orchestration.study_run import run_study

    study = spec.load_dict(study_raw(digits_dir, tmp_path_factory.mktemp("tunerun")))
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(rows=run_study(study)), daemon=True)
    thread.start()
    at_kill, last, deadline = None, TRIALS[-1], time.time() + 400
    while thread.is_alive() and at_kill is None and time.time() < deadline:
        done = {r["trial_name"]: r["status"] for r in stored_rows(study.study_uri)}
        pids = alive_actor_pids("TuneRun")
        if (
            done.get(TRIALS[0]) == "FINISHED"
            and done.get(TRIALS[1]) == "DIVERGED"
            and registered_steps(study.study_uri, last)
            and pids
        ):
            log = read_log(study.study_uri, last)
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            at_kill = {
                "registered": registered_steps(study.study_uri, last),
                "logged": log[-1]["step"] if log else 0,
                "topology": {
                    t: open(os.path.join(trial_dir(study.study_uri, t), "topology.json")).read()
                    for t in TRIALS
                },
            }
        time.sleep(0.1)
    thread.join(timeout=600)
    assert at_kill is not None, "the Tune run was never killed mid-study"
    return study, at_kill, out.get("rows"), free_cpus_after_study()


def test_a_killed_tune_run_is_started_again_and_ends_as_the_uninterrupted_run(tune_run_killed, baseline):
    import ray

    study, at_kill, rows, free_cpus = tune_run_killed
    assert at_kill["logged"] < STEPS  # killed mid-trial
    # The killed run's trial placement group (which Ray keeps until the job ends) was removed.
    assert free_cpus == ray.cluster_resources()["CPU"]
    assert rows is not None, "run_study did not return"
    assert sorted(r["trial_name"] for r in rows) == TRIALS  # each exactly once
    assert sorted(r["trial_name"] for r in stored_rows(study.study_uri)) == TRIALS
    want = {r["trial_name"]: r for r in stored_rows(baseline.study_uri)}
    for row in rows:
        for key in ("status", "step", "best_metric", "best_step", "diverged_at_step"):
            assert row.get(key) == want[row["trial_name"]].get(key), (row["trial_name"], key)
    for name in TRIALS[:2]:  # not started again: topology.json is rewritten by every start
        with open(os.path.join(trial_dir(study.study_uri, name), "topology.json")) as f:
            assert f.read() == at_kill["topology"][name], name
    with open(os.path.join(trial_dir(study.study_uri, TRIALS[-1]), "topology.json")) as f:
        resumed = json.load(f)["ranks"][0]["resumed_from_step"]
    assert max(at_kill["registered"]) <= resumed < STEPS  # started again, from its checkpoint
    for name in TRIALS:
        assert read_log(study.study_uri, name) == read_log(baseline.study_uri, name), name


def test_a_torn_latest_checkpoint_on_ray_storage_is_skipped(baseline, tmp_path):
    """Ray's latest registered checkpoint damaged on storage (its manifest gone, state.pt cut):
    the rerun of the Train run resumes from the newest committed one and ends the same."""
    from service.orchestration import launch, trial_summary

    study = spec.load_dict(study_raw_for(baseline, tmp_path))
    plan = TrialPlan(study, TRIALS[0], "explore", {"learning_rate": 0.05, "momentum": 0.9, "width": 4}, STEPS)
    launch.run_single(plan)
    latest = committed(study.study_uri, TRIALS[0])[STEPS]
    os.remove(os.path.join(latest, checkpoint.MANIFEST_FILE))
    with open(os.path.join(latest, checkpoint.STATE_FILE), "r+b") as f:
        f.truncate(100)
    result = launch.run_single(plan)
    with open(plan.topology_uri) as f:
        resumed = json.load(f)["ranks"][0]["resumed_from_step"]
    assert 0 < resumed < STEPS
    assert read_log(study.study_uri, TRIALS[0]) == read_log(baseline.study_uri, TRIALS[0])
    final = checkpoint.load(max(committed(study.study_uri, TRIALS[0]).items())[1])
    want = checkpoint.load(committed(baseline.study_uri, TRIALS[0])[STEPS])
    for key in want.model:
        assert torch.equal(final.model[key], want.model[key]), key
    summary = trial_summary.summarize(plan, result)
    assert summary["best_checkpoint"] != latest and checkpoint.is_complete(summary["best_checkpoint"])


def study_raw_for(baseline, tmp_path) -> dict:
    raw = spec.to_dict(baseline)
    raw["storage"] = str(tmp_path)
    return raw


def test_a_torn_ray_train_record_is_moved_aside_and_the_rerun_resumes(baseline, tmp_path):
    """Ray Train's record of the trial's checkpoints cut short on storage (what a full disk did to
    it): Ray Train's controller could not start from it, so every rerun failed. The rerun moves
    it aside, resumes from the newest committed checkpoint and keeps what an uninterrupted run keeps,
    and so does every run of the trial after it."""
    from service.orchestration import launch

    study = spec.load_dict(study_raw_for(baseline, tmp_path))
    plan = TrialPlan(study, TRIALS[0], "explore", {"learning_rate": 0.05, "momentum": 0.9, "width": 4}, STEPS)
    launch.run_single(plan)
    record = os.path.join(trial_dir(study.study_uri, TRIALS[0]), launch.RAY_TRAIN_RECORD)
    with open(record, "r+b") as f:
        f.truncate(0)
    launch.run_single(plan)
    with open(plan.topology_uri) as f:
        assert json.load(f)["ranks"][0]["resumed_from_step"] == STEPS
    assert read_log(study.study_uri, TRIALS[0]) == read_log(baseline.study_uri, TRIALS[0])
    want = sorted(committed(baseline.study_uri, TRIALS[0]))
    assert sorted(committed(study.study_uri, TRIALS[0])) == want
    # Ray's new record knows none of the checkpoints from before it: a run after the rerun (Tune's
    # retry of a rerun that failed later on) still keeps the best of all, not only those it knows,
    # and removes what a driver that died mid-copy left (a checkpoint folder with no manifest).
    half = os.path.join(trial_dir(study.study_uri, TRIALS[0]), "checkpoint_half_copied")
    shutil.copytree(committed(study.study_uri, TRIALS[0])[STEPS], half)
    os.remove(os.path.join(half, checkpoint.MANIFEST_FILE))
    launch.run_single(plan)
    assert sorted(committed(study.study_uri, TRIALS[0])) == want
    assert not os.path.exists(half)
