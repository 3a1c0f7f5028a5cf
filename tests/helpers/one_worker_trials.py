"""One-worker (fast path) trials of a study run on a cluster, checked against the same trial
trained uninterrupted by `loop.train` in this process (no Ray, no network): the metrics log
without timings and every kept checkpoint, bit for bit. What they wrote is read from storage
without touching what a running trial is writing."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import time

from service.distributed import checkpoint, fence
from service.distributed.topology import Topology
from service.planning.trial import TrialPlan
from tests.helpers.studies import same_nested
from tests.helpers.trainer_runs import Reporter, read_log, without_timing


def wait_for(what: str, condition, timeout_s: float, every_s: float = 0.2):
    """Poll `condition()` until it returns something truthy; that value. Fails after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(every_s)
    return value


def logged_steps(plan: TrialPlan) -> list[int]:
    with contextlib.suppress(FileNotFoundError, ValueError):
        return [r["step"] for r in read_log(plan)]
    return []


def committed_steps(trial_dir: str) -> list[int]:
    """Steps of the complete checkpoints (sharded ones too) of the trial in local folder
    `trial_dir`: what a restart resumes from. A checkpoint pruned while listed is left out."""
    with contextlib.suppress(OSError):
        names = [d for d in os.listdir(trial_dir) if d.startswith("checkpoint_")]
        folders = [os.path.join(trial_dir, d) for d in names]
        return sorted(checkpoint.step_of(d) for d in folders if checkpoint.is_complete(d))
    return []


def attempt_of(plan: TrialPlan) -> fence.Attempt | None:
    with contextlib.suppress(OSError, ValueError):
        return fence.read(plan.trial_uri)
    return None


def resumed_from(plan: TrialPlan) -> int:
    """The step the trial's latest start resumed from (its topology record)."""
    with open(plan.topology_uri) as f:
        return json.load(f)["ranks"][0]["resumed_from_step"]


def reference_run(plan: TrialPlan, folder: pathlib.Path) -> dict[int, str]:
    """Train `plan` (whose study stores elsewhere than the cluster's) uninterrupted in this
    process, on one torch thread as a one-CPU worker does: {step: checkpoint folder}."""
    import torch

    from service.trainer.loop import train

    folder.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reporter = Reporter(folder)
        train(plan, Topology(), reporter)
    finally:
        torch.set_num_threads(threads)
    return {checkpoint.step_of(d): d for _, d in reporter.reports if d}


def assert_same_trial(plan: TrialPlan, ref_plan: TrialPlan, ref_checkpoints: dict[int, str]) -> None:
    """Metrics log (without timings) and every kept checkpoint (model, optimizer, generators,
    step; history without timings) equal the reference's; the last step's is kept."""
    logs = [json.dumps([without_timing(r) for r in read_log(p)]) for p in (plan, ref_plan)]
    assert logs[0] == logs[1], plan.trial_name
    kept = committed_steps(plan.trial_uri)
    assert plan.max_train_steps in kept and set(kept) <= set(ref_checkpoints), (kept, sorted(ref_checkpoints))
    for step in kept:
        got = checkpoint.load(plan.layout.checkpoint(step))
        want = checkpoint.load(ref_checkpoints[step])
        history = [json.dumps([without_timing(r) for r in s.history]) for s in (got, want)]
        assert history[0] == history[1], (plan.trial_name, step)
        got.history, want.history = [], []
        assert same_nested(vars(got), vars(want)), (plan.trial_name, step)
