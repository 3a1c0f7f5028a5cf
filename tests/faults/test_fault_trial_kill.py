"""The single-worker fast path: the Tune trial process (which trains the trial itself) is
SIGKILLed mid-run; Tune restarts the trial, which resumes from its latest complete checkpoint,
and the study ends bitwise the same as an uninterrupted run (metrics, weights, kept checkpoints)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch

from service.distributed import checkpoint
from service.distributed.checkpoint_store import CheckpointStore
from service.trainer.loop import TIMING_FIELDS
from tests.helpers.studies import make_study, same_nested

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
STEPS, EVERY, TRIAL = 1500, 150, "explore-0000"


def study_in(digits_dir, storage, name="fast-faults"):
    return make_study(
        digits_dir,
        storage,
        name=name,
        training={"max_train_steps": STEPS, "eval_every_steps": EVERY, "num_checkpoints_to_keep": 2},
        rounds=[{"name": "explore", "num_trials": 1}],
    )


def trial_dir(study) -> str:
    return os.path.join(study.study_uri, "trials", TRIAL)


def log(study) -> list[dict]:
    with open(os.path.join(trial_dir(study), "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in TIMING_FIELDS} for line in f]


def complete_steps(study) -> list[int]:
    """Steps of the checkpoints a restarted trial could select, read from the files alone."""
    out = []
    for d in os.listdir(trial_dir(study)):
        meta = os.path.join(trial_dir(study), d, checkpoint.META_FILE)
        if d.startswith("checkpoint_") and os.path.exists(meta):
            with open(meta) as f:
                out.append(json.load(f)["step"])
    return sorted(out)


def logged_its_checkpoint(study) -> bool:
    """A checkpoint is complete and the metrics log has reached its step. The checkpoint is
    committed on a background thread (`training.async_checkpoint`) while the loop writes the
    log, so either can come first; killing in between read a log not yet written."""
    if not os.path.isdir(trial_dir(study)) or not complete_steps(study):
        return False
    if not os.path.exists(os.path.join(trial_dir(study), "metrics.jsonl")):
        return False
    try:
        rows = log(study)
    except json.JSONDecodeError:  # a row being appended
        return False
    return bool(rows) and rows[-1]["step"] >= max(complete_steps(study))


def test_killed_trial_process_resumes_to_the_same_result(ray_cluster, digits_dir, tmp_path):
    from service.orchestration.study_run import run_study

    # The uninterrupted reference runs beside the killed study (one CPU each, on its own name).
    reference = study_in(digits_dir, tmp_path / "reference", name="fast-faults-reference")
    ref_outcome = {}
    ref_runner = threading.Thread(target=lambda: ref_outcome.update(rows=run_study(reference)))
    ref_runner.start()

    study = study_in(digits_dir, tmp_path / "killed")
    outcome = {}
    runner = threading.Thread(target=lambda: outcome.update(rows=run_study(study)))
    runner.start()
    killed_after = pid = None
    deadline = time.time() + 300
    while runner.is_alive() and time.time() < deadline and pid is None:
        if logged_its_checkpoint(study):
            with open(os.path.join(trial_dir(study), "topology.json")) as f:
                pid = json.load(f)["ranks"][0]["pid"]
            persisted = max(complete_steps(study))
            os.kill(pid, signal.SIGKILL)
            killed_after = log(study)[-1]["step"]
        time.sleep(0.05)
    runner.join(timeout=400)
    ref_runner.join(timeout=400)
    assert pid is not None and killed_after < STEPS, "the trial was never killed mid-run"
    (ref_row,) = ref_outcome["rows"]

    with open(os.path.join(trial_dir(study), "topology.json")) as f:
        restarted = json.load(f)["ranks"][0]
    assert restarted["pid"] != pid
    assert persisted <= restarted["resumed_from_step"] <= killed_after
    assert log(study) == log(reference)

    (row,) = outcome["rows"]
    assert row["status"] == ref_row["status"] == "FINISHED"
    assert (row["best_step"], row["best_metric"]) == (ref_row["best_step"], ref_row["best_metric"])
    assert complete_steps(study) == complete_steps(reference)
    tr = study.training
    got = CheckpointStore(trial_dir(study), 2, tr.metric, tr.mode).latest_state()
    want = CheckpointStore(trial_dir(reference), 2, tr.metric, tr.mode).latest_state()
    assert got.step == want.step == STEPS
    for key in want.model:
        assert torch.equal(got.model[key], want.model[key]), key
    assert same_nested(got.rng_states, want.rng_states)
