"""Multi-worker trials on reused pools (the default): a round of two 2-worker trials runs at once,
each on a pool of its own. World rank 1 (a pool actor) or world rank 0 (the Tune trial's own
process, which owns the pool's actors) of the first trial is SIGKILLed mid-run; that trial fails
on every rank, Tune restarts it on a new pool, it resumes from its latest complete checkpoint,
and it ends bitwise the same as an uninterrupted run (metrics, weights, every rank's RNG state,
kept checkpoints). The other trial is not touched: one attempt, the same processes throughout,
the same results as uninterrupted."""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest

from service.distributed import checkpoint
from service.distributed.checkpoint_store import CheckpointStore
from service.trainer.loop import TIMING_FIELDS
from tests.helpers.one_worker_trials import wait_for
from tests.helpers.studies import make_study, same_nested

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
STEPS, EVERY = 300, 30
KILLED, OTHER = "explore-0000", "explore-0001"


def study_in(digits_dir, storage):
    return make_study(
        digits_dir,
        storage,
        name="pool-faults",
        scaling={"num_hosts": 1, "workers_per_host": 2, "cpus_per_worker": 0.5},
        training={"max_train_steps": STEPS, "eval_every_steps": EVERY, "num_checkpoints_to_keep": 2},
        search={
            "learning_rate": {"role": "nuisance", "type": "choice", "values": [0.05, 0.1]},
            "momentum": {"role": "fixed", "value": 0.9},
            "width": {"role": "fixed", "value": 4},
        },
        rounds=[{"name": "explore", "kind": "grid", "num_trials": 2, "max_concurrent_trials": 2}],
    )


def trial_dir(study, trial: str) -> str:
    return os.path.join(study.study_uri, "trials", trial)


def log(study, trial: str) -> list[dict]:
    path = os.path.join(trial_dir(study, trial), "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in TIMING_FIELDS} for line in f]


def ranks(study, trial: str) -> list[dict]:
    with open(os.path.join(trial_dir(study, trial), "topology.json")) as f:
        return sorted(json.load(f)["ranks"], key=lambda r: r["world_rank"])


def attempt(study, trial: str) -> int:
    with open(os.path.join(trial_dir(study, trial), "attempt.json")) as f:
        return json.load(f)["attempt"]


def complete_steps(study, trial: str) -> list[int]:
    """Steps of the checkpoints a restarted trial could select, read from the files alone."""
    folder, out = trial_dir(study, trial), []
    for d in os.listdir(folder) if os.path.isdir(folder) else []:
        meta = os.path.join(folder, d, checkpoint.META_FILE)
        if d.startswith("checkpoint_") and os.path.exists(meta):
            with open(meta) as f:
                out.append(json.load(f)["step"])
    return sorted(out)


def latest_state(study, trial: str):
    tr = study.training
    return CheckpointStore(trial_dir(study, trial), 2, tr.metric, tr.mode).latest_state()


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster, digits_dir, tmp_path_factory):
    """The same study run without a kill, once for both cases: (study, its rows by trial)."""
    from service.orchestration.study_run import run_study

    reference = study_in(digits_dir, tmp_path_factory.mktemp("reference"))
    return reference, {r["trial_name"]: r for r in run_study(reference)}


def signal_ranks(seen_ranks: list[dict], sig: int) -> None:
    for r in seen_ranks:
        os.kill(r["pid"], sig)


def kill_mid_run(study, rank: int) -> dict:
    """SIGKILL world rank `rank` of KILLED once it has a complete checkpoint, while OTHER trains.
    Each trial's ranks are SIGSTOPped while the test reads where it is, so neither can finish
    between that reading and the kill, however late one trial starts after the other. Returns
    what was there then: the killed ranks, KILLED's last committed and logged steps, OTHER's ranks
    and last logged step."""
    wait_for(f"complete checkpoint of {KILLED}", lambda: complete_steps(study, KILLED), 300, 0.05)
    killed = ranks(study, KILLED)
    signal_ranks(killed, signal.SIGSTOP)
    seen = {"killed": killed, "persisted": max(complete_steps(study, KILLED))}
    logged = log(study, KILLED)
    seen["killed_after"] = logged[-1]["step"] if logged else 0
    wait_for(f"logged step of {OTHER}", lambda: log(study, OTHER), 300, 0.05)
    seen["other"] = ranks(study, OTHER)
    signal_ranks(seen["other"], signal.SIGSTOP)
    seen["other_after"] = log(study, OTHER)[-1]["step"]
    os.kill(killed[rank]["pid"], signal.SIGKILL)
    signal_ranks([r for r in killed if r["world_rank"] != rank] + seen["other"], signal.SIGCONT)
    return seen


def assert_same_trial(study, reference, trial: str, row: dict, ref_row: dict) -> None:
    assert log(study, trial) == log(reference, trial)
    assert row["status"] == ref_row["status"] == "FINISHED"
    assert (row["best_step"], row["best_metric"]) == (ref_row["best_step"], ref_row["best_metric"])
    assert complete_steps(study, trial) == complete_steps(reference, trial)
    got, want = latest_state(study, trial), latest_state(reference, trial)
    assert got.step == want.step == STEPS
    assert same_nested(got.model, want.model)
    assert same_nested(got.rng_states, want.rng_states)


@pytest.mark.parametrize("rank", [1, 0], ids=["pool-actor", "trial-process"])
def test_a_killed_pool_rank_restarts_only_its_own_trial(uninterrupted, digits_dir, tmp_path, rank):
    from service.orchestration.study_run import run_study

    reference, ref_rows = uninterrupted
    study = study_in(digits_dir, tmp_path / "killed")
    outcome = {}
    runner = threading.Thread(target=lambda: outcome.update(rows=run_study(study)))
    runner.start()
    seen = kill_mid_run(study, rank)
    runner.join(timeout=400)
    assert seen["killed_after"] < STEPS and seen["other_after"] < STEPS, "killed after a trial ended"

    restarted = ranks(study, KILLED)
    assert {r["pid"] for r in restarted}.isdisjoint(r["pid"] for r in seen["killed"])  # a new pool
    # From its latest complete checkpoint: committed before the kill, or one a save in flight then
    # committed after it, at most one eval interval past the last logged step.
    assert seen["persisted"] <= restarted[0]["resumed_from_step"] <= seen["killed_after"] + EVERY
    assert restarted[0]["resumed_from_step"] == restarted[1]["resumed_from_step"]
    assert attempt(study, KILLED) == 2
    # The other trial trained on through the kill: its one attempt, on its own pool throughout.
    assert attempt(study, OTHER) == 1 and ranks(study, OTHER) == seen["other"]

    rows = {r["trial_name"]: r for r in outcome["rows"]}
    for trial in (KILLED, OTHER):
        assert_same_trial(study, reference, trial, rows[trial], ref_rows[trial])
