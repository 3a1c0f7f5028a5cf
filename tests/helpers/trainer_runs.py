"""Running the single-process trainer loop in tests: a trial plan, a recording reporter, the
metrics log read back."""

from __future__ import annotations

import copy
import json
import shutil

import torch

from service.distributed.checkpoint import TrialState
from service.planning.trial import TrialPlan
from service.study import spec

HPARAMS = {"learning_rate": 0.1, "momentum": 0.9, "width": 4}


class Interrupted(Exception):
    """Raised by a test reporter to stop a run after a given report (a preempted worker)."""


class Reporter:
    """Records every report and copies each checkpoint directory before train() deletes it."""

    def __init__(self, store, restore_state: TrialState | None = None, stop_after: int | None = None):
        self.store = store
        self.restore_state = restore_state
        self.stop_after = stop_after
        self.reports: list[tuple[dict, str | None]] = []

    def report(self, metrics, checkpoint_dir):
        copied = None
        if checkpoint_dir is not None:
            copied = str(self.store / f"ckpt-{len(self.reports)}-step{metrics['step']}")
            shutil.copytree(checkpoint_dir, copied)
        self.reports.append((copy.deepcopy(metrics), copied))
        if self.stop_after is not None and len(self.reports) == self.stop_after:
            raise Interrupted

    def restore(self):
        return self.restore_state

    @property
    def metrics(self) -> list[dict]:
        return [m for m, _ in self.reports]


def make_plan(digits_dir, storage, trial_name="r1-0", hparams=None, workload="digits", **training):
    tr = {
        "max_train_steps": 70,
        "batch_size": 32,
        "eval_batch_size": 64,  # 270 validation rows: the last eval batch is short
        "eval_every_steps": 30,
        "seed": 0,
        "optimizer": "nesterov",
        "schedule": {"kind": "cosine", "warmup_steps": 5},
    }
    tr.update(training)
    study = spec.load_dict(
        {
            "name": "loop",
            "workload": workload,
            "data": {s: str(digits_dir / s) for s in ("train", "validation")},
            "storage": str(storage),
            "training": tr,
            "search": {"learning_rate": {"role": "fixed", "value": 0.1}},
            "rounds": [{"name": "r1", "num_trials": 1}],
        }
    )
    return TrialPlan(study, trial_name, "r1", dict(hparams or HPARAMS))


def read_log(plan: TrialPlan) -> list[dict]:
    with open(plan.metrics_uri) as f:
        return [json.loads(line) for line in f if line.strip()]


def without_timing(row: dict) -> dict:
    from service.trainer.loop import TIMING_FIELDS

    return {k: v for k, v in row.items() if k not in TIMING_FIELDS}


def plain_loop_parts(plan: TrialPlan):
    """What a plain single-process replay of `plan` starts from: its workload, its model
    seeded as the trial's, the trial's optimizer and its rank-0 training stream."""
    from service import workloads
    from service.data.files import list_files
    from service.data.loader import TrainStream
    from service.data.sharding import train_shard
    from service.distributed.topology import data_seed, init_seed
    from service.trainer.loop import build_optimizer

    workload = workloads.get(plan.study.workload)
    torch.manual_seed(init_seed(plan.trial_seed))
    model = workload.build_model(plan.hparams)
    optimizer = build_optimizer(plan.study.training.optimizer, model.parameters(), plan.hparams)
    stream = TrainStream(
        workload,
        train_shard(list_files(plan.study.data.train), 1, 0, 1, 0),
        plan.study.training.batch_size,
        data_seed(plan.trial_seed, 0, 0),
        plan.study.input.shuffle_window_row_groups,
        shuffle_window_bytes=plan.study.input.shuffle_window_mb << 20,
    )
    return workload, model, optimizer, stream


class NoCheckpoints:
    """A reporter that keeps nothing (the metrics log is what a test compares)."""

    def report(self, metrics, checkpoint_dir):
        pass

    def restore(self):
        return None


def train_in_process(plan: TrialPlan) -> None:
    """The trial in the loop in this process, on one torch thread as a one-CPU worker trains."""
    from service.distributed.topology import Topology
    from service.trainer.loop import train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(plan, Topology(), NoCheckpoints())
    finally:
        torch.set_num_threads(threads)
