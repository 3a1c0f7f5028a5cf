"""On CUDA: the prefetch thread hands over pinned batches, a training step makes no device-to-host
sync (torch's sync debug mode finds none), and `input.sync_debug` names a sync a workload adds
to its step. Skipped without a GPU (tests/multiprocess/test_trainer_loop.py checks on CPU that the step
reads no tensor back to the host)."""

from __future__ import annotations

import warnings

import pytest
import torch

from service.data.files import list_files
from service.data.loader import TrainStream
from service.data.prefetch import prefetch_stream
from service.data.sharding import train_shard
from service.distributed.topology import Topology
from service.planning.trial import TrialPlan
from service.study import spec
from service.trainer.loop import train
from service.workloads.digits import Digits
from tests.helpers.trainer_runs import HPARAMS, Reporter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SYNC_WARNING = "called a synchronizing CUDA operation"


class SyncingDigits(Digits):
    """Digits whose training forward reads a value back to the host (a sync on CUDA)."""

    name = "syncing_digits"

    def forward(self, model, batch):
        outputs = model(batch["features"])
        if model.training:
            self.last_max = float(outputs.max())  # the sync the diagnostic must name
        return outputs


def plan_on(digits_dir, storage, workload: str) -> TrialPlan:
    study = spec.load_dict(
        {
            "name": "sync",
            "workload": workload,
            "data": {s: str(digits_dir / s) for s in ("train", "validation")},
            "storage": str(storage),
            "training": {"max_train_steps": 20, "batch_size": 32, "eval_every_steps": 10, "seed": 0},
            "search": {"learning_rate": {"role": "fixed", "value": 0.1}},
            "rounds": [{"name": "r1", "num_trials": 1}],
            "input": {"sync_debug": True},
        }
    )
    return TrialPlan(study, "r1-0", "r1", dict(HPARAMS))


def test_prefetched_batches_are_pinned_on_cuda(digits_dir):
    stream = TrainStream(Digits(), train_shard(list_files(str(digits_dir / "train")), 1, 0, 1, 0), 32, 0)
    pinned = next(prefetch_stream(stream, 0, 2, pin=True))
    assert all(t.is_pinned() for t in pinned.values())
    assert torch.equal(pinned["features"], stream.batch(0)["features"])  # the same batch
    assert not any(t.is_pinned() for t in next(prefetch_stream(stream, 0, 2)).values())


def run_recording_warnings(plan: TrialPlan, tmp_path) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(plan, Topology(), Reporter(tmp_path), device=torch.device("cuda"))
    torch.cuda.set_sync_debug_mode("default")
    return [w for w in caught if SYNC_WARNING in str(w.message)]


def test_a_training_step_makes_no_host_sync(digits_dir, tmp_path):
    assert run_recording_warnings(plan_on(digits_dir, tmp_path / "s", "digits"), tmp_path) == []


def test_sync_debug_names_a_sync_inside_the_step(digits_dir, tmp_path):
    syncs = run_recording_warnings(plan_on(digits_dir, tmp_path / "s", f"{__name__}:SyncingDigits"), tmp_path)
    assert syncs and any(w.filename == __file__ for w in syncs)  # the line that syncs
