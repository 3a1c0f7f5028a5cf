"""Ray Data input workers serve a rank exactly the local loader's batches (same shard, same
order, from any start step), and a trial trained through them equals one trained locally."""

from __future__ import annotations

import json

import pytest
import torch

from service.data.files import list_files
from service.data.loader import TrainStream
from service.data.sharding import train_shard
from service.orchestration.ray_input import ray_data_source
from service.planning.trial import TrialPlan
from service.study import spec
from service.trainer.loop import TIMING_FIELDS
from service.workloads.digits import Digits
from tests.helpers.trainer_runs import train_in_process

pytestmark = pytest.mark.ray


def test_ray_data_batches_are_the_local_batches(ray_cluster, digits_dir):
    # Host 1 of 2, worker 0 of 2: a real shard of a multi-host layout.
    shard = train_shard(list_files(str(digits_dir / "train")), 2, 1, 2, 0)
    stream = TrainStream(Digits(), shard, 16, data_seed=7, shuffle_window_row_groups=2)
    source = ray_data_source(num_workers=2, cpus_per_worker=0.25, windows_per_dataset=3)
    for start in (0, 23):
        local = stream.iterate(start)
        remote = source(stream, start)
        for _ in range(30):  # past an epoch (~315 rows / 16) and a dataset of 3 windows
            want, got = next(local), next(remote)
            for key in want:
                assert torch.equal(got[key], want[key]), (start, key)


def test_a_ray_train_trial_through_ray_data_equals_the_local_one(ray_cluster, digits_dir, tmp_path):
    """A Ray Train run of one trial with Ray Data input workers injected by the launch edge, and
    the same trial in the loop in-process with its local loader (one torch thread, as the run's
    one-CPU worker): the same metrics log, bit for bit."""
    from service.orchestration import launch

    logs, raw = {}, {}
    for workers in ("local", "ray_data"):
        study = spec.load_dict(
            {
                "name": f"rd-{workers}".replace("_", "-"),
                "workload": "digits",
                "data": {s: str(digits_dir / s) for s in ("train", "validation")},
                "storage": str(tmp_path),
                "training": {"max_train_steps": 30, "batch_size": 32, "eval_every_steps": 15},
                "search": {
                    "learning_rate": {"role": "fixed", "value": 0.1},
                    "width": {"role": "fixed", "value": 4},
                },
                "rounds": [{"name": "r1", "num_trials": 1}],
                "input": {"workers": workers, "num_input_workers": 1, "cpus_per_input_worker": 0.25},
            }
        )
        plan = TrialPlan(study, "r1-0", "r1", {"learning_rate": 0.1, "width": 4}, max_train_steps=30)
        if workers == "ray_data":
            launch.run_single(plan)
        else:
            train_in_process(plan)
        with open(plan.metrics_uri) as f:
            raw[workers] = [json.loads(line) for line in f]
        logs[workers] = [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in raw[workers]]
    assert logs["ray_data"] == logs["local"]
    # The rank itself read nothing through Ray Data (the actors did); locally it did (the whole
    # shard is one window here, read before the first step and cached: in the first interval).
    assert all(r["input/read_s"] == 0 for r in raw["ray_data"])
    assert raw["local"][0]["input/read_s"] > 0
    assert [r["step"] for r in logs["local"]] == [15, 30]
