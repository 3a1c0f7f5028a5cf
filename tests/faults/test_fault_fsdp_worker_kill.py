"""An FSDP trial on Ray Train (2 workers, lm) whose rank 1 is SIGKILLed once a sharded checkpoint
is committed: Ray Train restarts the worker group, every rank reads its part of the latest
sharded checkpoint, and the trial ends bitwise equal to the uninterrupted one, trained by gloo
processes (every evaluation without timings, the last checkpoint's shard files byte for byte)."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import threading
import time

import pytest

from service.data import text
from service.distributed.checkpoint_store import CheckpointStore
from tests.helpers.fsdp_runs import SEQ_LEN, lm_plan, train_rank
from tests.helpers.gloo import run_gloo
from tests.helpers.trainer_runs import read_log, without_timing

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
STEPS, EVERY = 240, 30


def plan_in(data_dir, storage):
    return lm_plan(data_dir, storage, max_train_steps=STEPS, eval_every_steps=EVERY, async_checkpoint=True)


def committed_checkpoints(plan) -> list[tuple[str, dict]]:
    """The trial's committed checkpoints, read without touching what its ranks are writing."""
    tr = plan.study.training
    return CheckpointStore(
        plan.trial_uri, tr.num_checkpoints_to_keep, tr.metric, tr.mode, clean=False
    ).complete()


def shard_files(plan) -> dict[str, bytes]:
    folder = pathlib.Path(plan.trial_uri) / f"checkpoint_{STEPS:08d}" / "model"
    return {p.name: p.read_bytes() for p in folder.glob("__*.distcp")}


def test_a_killed_fsdp_worker_resumes_from_its_sharded_checkpoint_bitwise(ray_cluster, tmp_path):
    from service.orchestration import launch

    text.write_text(str(tmp_path / "text"), 20_000, SEQ_LEN)
    plan = plan_in(tmp_path / "text", tmp_path / "killed")
    runner = threading.Thread(target=launch.run_single, args=(plan,))
    runner.start()
    killed_after, deadline = None, time.time() + 300
    while runner.is_alive() and killed_after is None and time.time() < deadline:
        committed = committed_checkpoints(plan) if os.path.exists(plan.trial_uri) else []
        if committed:
            with open(plan.topology_uri) as f:
                pid = json.load(f)["ranks"][1]["pid"]
            os.kill(pid, signal.SIGKILL)
            killed_after, persisted = read_log(plan)[-1]["step"], committed[-1][1]["step"]
        time.sleep(0.05)
    reference = plan_in(tmp_path / "text", tmp_path / "reference")
    (tmp_path / "gloo").mkdir()
    run_gloo(train_rank, 2, tmp_path / "gloo", reference, None, True)  # while the trial resumes
    runner.join(timeout=300)
    assert killed_after is not None and killed_after < STEPS, "rank 1 was never killed mid-run"

    with open(plan.topology_uri) as f:
        restarted = json.load(f)["ranks"][1]
    assert restarted["pid"] != pid
    assert persisted <= restarted["resumed_from_step"] <= killed_after
    assert [without_timing(r) for r in read_log(plan)] == [without_timing(r) for r in read_log(reference)]
    assert len(shard_files(reference)) == 2 and shard_files(plan) == shard_files(reference)
