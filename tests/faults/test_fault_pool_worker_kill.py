"""A multi-worker trial on a reused pool (`scaling.reuse_workers`): world rank 1 (a pool actor)
or world rank 0 (the Tune trial's own process, which owns the pool's actors) is SIGKILLed
mid-run; the trial fails on every rank, Tune restarts it on a new pool, it resumes from its
latest complete checkpoint, and it ends bitwise the same as an uninterrupted run (metrics,
weights, every rank's RNG state, kept checkpoints)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from service.distributed import checkpoint
from service.distributed.checkpoint_store import CheckpointStore
from service.trainer.loop import TIMING_FIELDS
from tests.helpers.studies import make_study, same_nested

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
STEPS, EVERY, TRIAL = 600, 60, "explore-0000"


def study_in(digits_dir, storage):
    return make_study(
        digits_dir,
        storage,
        name="pool-faults",
        scaling={"num_hosts": 1, "workers_per_host": 2, "reuse_workers": True},
        training={"max_train_steps": STEPS, "eval_every_steps": EVERY, "num_checkpoints_to_keep": 2},
        rounds=[{"name": "explore", "num_trials": 1}],
    )


def trial_dir(study) -> str:
    return os.path.join(study.study_uri, "trials", TRIAL)


def log(study) -> list[dict]:
    with open(os.path.join(trial_dir(study), "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in TIMING_FIELDS} for line in f]


def ranks(study) -> list[dict]:
    with open(os.path.join(trial_dir(study), "topology.json")) as f:
        return sorted(json.load(f)["ranks"], key=lambda r: r["world_rank"])


def complete_steps(study) -> list[int]:
    """Steps of the checkpoints a restarted trial could select, read from the files alone."""
    out = []
    for d in os.listdir(trial_dir(study)):
        meta = os.path.join(trial_dir(study), d, checkpoint.META_FILE)
        if d.startswith("checkpoint_") and os.path.exists(meta):
            with open(meta) as f:
                out.append(json.load(f)["step"])
    return sorted(out)


def latest_state(study):
    tr = study.training
    return CheckpointStore(trial_dir(study), 2, tr.metric, tr.mode).latest_state()


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster, digits_dir, tmp_path_factory):
    """The same study run without a kill, once for both cases: (study, its one row)."""
    from service.orchestration.coordinator import run_study

    reference = study_in(digits_dir, tmp_path_factory.mktemp("reference"))
    (ref_row,) = run_study(reference)
    return reference, ref_row


@pytest.mark.parametrize("rank", [1, 0], ids=["pool-actor", "trial-process"])
def test_killed_pool_worker_resumes_to_the_same_result(uninterrupted, digits_dir, tmp_path, rank):
    from service.orchestration.coordinator import run_study

    reference, ref_row = uninterrupted

    study = study_in(digits_dir, tmp_path / "killed")
    outcome = {}
    runner = threading.Thread(target=lambda: outcome.update(rows=run_study(study)))
    runner.start()
    killed = None
    deadline = time.time() + 300
    while runner.is_alive() and time.time() < deadline and killed is None:
        if os.path.isdir(trial_dir(study)) and complete_steps(study):
            killed = ranks(study)
            persisted = max(complete_steps(study))
            os.kill(killed[rank]["pid"], signal.SIGKILL)
            killed_after = log(study)[-1]["step"]
        time.sleep(0.05)
    runner.join(timeout=400)
    assert killed is not None and killed_after < STEPS, "the worker was never killed mid-run"

    restarted = ranks(study)
    assert {r["pid"] for r in restarted}.isdisjoint(r["pid"] for r in killed)  # a new pool
    assert persisted <= restarted[0]["resumed_from_step"] <= killed_after
    assert restarted[0]["resumed_from_step"] == restarted[1]["resumed_from_step"]
    assert log(study) == log(reference)

    (row,) = outcome["rows"]
    assert row["status"] == ref_row["status"] == "FINISHED"
    assert (row["best_step"], row["best_metric"]) == (ref_row["best_step"], ref_row["best_metric"])
    assert complete_steps(study) == complete_steps(reference)
    got, want = latest_state(study), latest_state(reference)
    assert got.step == want.step == STEPS
    assert same_nested(got.model, want.model)
    assert same_nested(got.rng_states, want.rng_states)
