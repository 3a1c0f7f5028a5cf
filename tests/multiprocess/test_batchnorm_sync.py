"""Cross-rank BatchNorm statistics and identical initial weights, on CPU gloo process groups."""

from __future__ import annotations

import copy
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

from service.distributed import checkpoint
from service.distributed.topology import Topology
from service.nn.batchnorm import sync_batchnorm_stats
from service.planning.trial import TrialPlan
from service.study import spec
from service.trainer.loop import TIMING_FIELDS, train
from service.workloads.digits import Digits
from tests.helpers.gloo import run_gloo

HPARAMS = {"learning_rate": 0.1, "momentum": 0.9, "width": 4}


def bn_model() -> nn.Module:
    return nn.ModuleDict(
        {"a": nn.BatchNorm1d(3), "b": nn.BatchNorm2d(2), "cumulative": nn.BatchNorm1d(3, momentum=None)}
    )


def a_batch(rank):
    # Channel means grow with the rank; the last channel sits far from zero with a small spread
    # (as raw, unnormalised features do).
    loc = torch.tensor([0.0, 2.0, 200.0]) + torch.tensor([1.0, -1.0, 1.0]) * rank
    scale = torch.tensor([1.0, 0.5, 0.05]) * (1 + rank)
    return torch.randn(32, 3) * scale + loc


def bn_rank(rank, world):
    """Each rank feeds its BN layers data of its own location and scale (the momentum=None layer
    counts 3 + rank batches); returns the running statistics before and after the sync, the
    batches' statistics, and the statistics after one more batch on every rank."""
    torch.manual_seed(rank)
    model = bn_model().train()
    for _ in range(5):
        model["a"](a_batch(rank))
        model["b"](torch.randn(8, 2, 4, 4) * (1 + rank) - 3 * rank)
    batches = [a_batch(rank) for _ in range(3 + rank)]
    for x in batches:
        model["cumulative"](x)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sync_batchnorm_stats(model)
    after = {k: v.clone() for k, v in model.state_dict().items()}
    batches.append(a_batch(rank))
    model["cumulative"](batches[-1])
    return {
        "before": before,
        "after": after,
        "batches": torch.stack(batches),
        "continued": {k: v.clone() for k, v in model["cumulative"].state_dict().items()},
    }


def test_sync_averages_running_stats_of_all_ranks(tmp_path):
    world = 3
    results = run_gloo(bn_rank, world, tmp_path)

    for layer in ("a", "b"):
        means = np.stack([r["before"][f"{layer}.running_mean"].double().numpy() for r in results])
        variances = np.stack([r["before"][f"{layer}.running_var"].double().numpy() for r in results])
        for r in results:  # the EMAs' plain mean over ranks (not the variance of the union)
            after = r["after"]
            np.testing.assert_allclose(after[f"{layer}.running_mean"].numpy(), means.mean(axis=0), rtol=1e-6)
            np.testing.assert_allclose(
                after[f"{layer}.running_var"].numpy(), variances.mean(axis=0), rtol=1e-6
            )
            assert int(after[f"{layer}.num_batches_tracked"]) == 5
        # Rank 0's own statistics (what DDP's broadcast_buffers would spread) are not the result.
        rank0 = results[0]["before"]
        assert not np.allclose(rank0[f"{layer}.running_mean"].numpy(), means.mean(axis=0), rtol=1e-3)
        assert not np.allclose(rank0[f"{layer}.running_var"].numpy(), variances.mean(axis=0), rtol=1e-3)
        # And the ranks really did start from different statistics.
        assert not np.allclose(means[0], means[1], rtol=1e-3)
    for r in results[1:]:  # bit-identical on every rank
        for key, value in r["after"].items():
            assert torch.equal(value, results[0]["after"][key]), key

    # momentum=None: a cumulative average, so the synced statistics are the average of every
    # batch's statistics on every rank (3 + 4 + 5 batches), computed here from the batches.
    x = [r["batches"].double().numpy() for r in results]  # [batches, 32, 3] per rank
    synced = np.concatenate([b[:-1] for b in x])
    expected_mean = synced.mean(axis=1).mean(axis=0)
    expected_var = synced.var(axis=1, ddof=1).mean(axis=0)
    for r in results:
        after = r["after"]
        np.testing.assert_allclose(after["cumulative.running_mean"].numpy(), expected_mean, rtol=1e-5)
        np.testing.assert_allclose(after["cumulative.running_var"].numpy(), expected_var, rtol=1e-5)
        assert int(after["cumulative.num_batches_tracked"]) == 4  # the ranks' mean count
    # The ranks did count differently, so the plain mean of their averages is not the answer.
    plain_mean = np.mean([r["before"]["cumulative.running_mean"].double().numpy() for r in results], axis=0)
    assert not np.allclose(plain_mean, expected_mean, rtol=1e-4)

    # One more batch on every rank: the mean over ranks is still the average over all batches.
    everything = np.concatenate(x)
    continued_mean = np.mean([r["continued"]["running_mean"].double().numpy() for r in results], axis=0)
    continued_var = np.mean([r["continued"]["running_var"].double().numpy() for r in results], axis=0)
    np.testing.assert_allclose(continued_mean, everything.mean(axis=1).mean(axis=0), rtol=1e-5)
    np.testing.assert_allclose(continued_var, everything.var(axis=1, ddof=1).mean(axis=0), rtol=1e-5)


def test_sync_is_a_no_op_without_a_process_group():
    model = bn_model().train()
    model["a"](torch.randn(16, 3) + 5)
    before = copy.deepcopy(model.state_dict())
    sync_batchnorm_stats(model)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


# ------------------------------------------------------------------ train() on two gloo ranks

BUILT: list[tuple[dict, nn.Module]] = []


class RecordingDigits(Digits):
    """Digits that keeps the model train() builds and a copy of its initial weights."""

    def build_model(self, hparams):
        model = super().build_model(hparams)
        BUILT.append((copy.deepcopy(model.state_dict()), model))
        return model


class CopyingReporter:
    def __init__(self, store):
        self.store = store
        self.metrics: list[dict] = []
        self.checkpoints: list[str | None] = []

    def report(self, metrics, checkpoint_dir):
        copied = None
        if checkpoint_dir is not None:
            copied = f"{self.store}/ckpt-step{metrics['step']}"
            shutil.copytree(checkpoint_dir, copied)
        self.metrics.append(copy.deepcopy(metrics))
        self.checkpoints.append(copied)

    def restore(self):
        return None


def make_plan(digits_dir: str, storage: str, workload: str, world: int) -> TrialPlan:
    study = spec.load_dict(
        {
            "name": "bnsync",
            "workload": workload,
            "data": {s: f"{digits_dir}/{s}" for s in ("train", "validation")},
            "storage": storage,
            "scaling": {"num_hosts": 1, "workers_per_host": world},
            "training": {
                "max_train_steps": 40,
                "batch_size": 32,
                "eval_batch_size": 64,
                "eval_every_steps": 20,
                "seed": 3,
                "optimizer": "nesterov",
                "schedule": {"kind": "cosine", "warmup_steps": 4},
            },
            "search": {"learning_rate": {"role": "fixed", "value": 0.1}},
            "rounds": [{"name": "r1", "num_trials": 1}],
        }
    )
    return TrialPlan(study, "r1-0", "r1", dict(HPARAMS))


def train_rank(rank, world, digits_dir, storage, workload):
    torch.manual_seed(1000 + rank)  # a different global RNG state on every rank
    unseeded = Digits().build_model(HPARAMS).state_dict()
    topo = Topology(
        world_rank=rank, world_size=world, host_rank=0, num_hosts=1, local_rank=rank, workers_per_host=world
    )
    reporter = CopyingReporter(storage)
    summary = train(make_plan(digits_dir, storage, workload, world), topo, reporter)
    initial, model = BUILT[-1]
    return {
        "unseeded": unseeded,
        "initial": initial,
        "final": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "metrics": reporter.metrics,
        "checkpoints": reporter.checkpoints,
        "status": summary["status"],
    }


def test_two_rank_training_same_init_synced_stats_and_correct_eval(digits_dir, tmp_path):
    world = 2
    storage = tmp_path / "storage"
    storage.mkdir()
    results = run_gloo(
        train_rank, world, tmp_path, str(digits_dir), str(storage), f"{__name__}:RecordingDigits"
    )
    r0, r1 = results

    # Without train()'s seeding the ranks would build different weights ...
    assert any(not torch.equal(r0["unseeded"][k], r1["unseeded"][k]) for k in r0["unseeded"])
    # ... with it, the initial weights are bit-identical.
    for key in r0["initial"]:
        assert torch.equal(r0["initial"][key], r1["initial"][key]), key

    # After training (DDP gradients + BN statistics synced before each eval) every tensor of the
    # model, BatchNorm running statistics included, is identical on both ranks.
    for key in r0["final"]:
        assert torch.equal(r0["final"][key], r1["final"][key]), key

    assert r0["status"] == r1["status"] == "finished"
    assert [m["step"] for m in r0["metrics"]] == [20, 40]
    assert [{k: v for k, v in m.items() if k not in TIMING_FIELDS} for m in r0["metrics"]] == [
        {k: v for k, v in m.items() if k not in TIMING_FIELDS} for m in r1["metrics"]
    ]
    assert r1["checkpoints"] == [None, None]  # only rank 0 writes checkpoints

    # The checkpoint holds the final model, and the reported validation metrics (each rank
    # evaluating half of the rows) equal an evaluation of it over all validation rows.
    saved = checkpoint.load(r0["checkpoints"][-1])
    for key in r0["final"]:
        assert torch.equal(saved.model[key], r0["final"][key]), key
    model = Digits().build_model(HPARAMS)
    model.load_state_dict(saved.model)
    model.eval()
    table = pq.read_table(str(digits_dir / "validation"), columns=["pixels", "label"])
    pixels = np.asarray(table.column("pixels").to_pylist(), dtype=np.float32)
    labels = table.column("label").to_numpy()
    with torch.no_grad():
        logits = model(torch.from_numpy(pixels).view(-1, 1, 8, 8)).double().numpy()
    top = logits.max(axis=1)
    log_z = top + np.log(np.exp(logits - top[:, None]).sum(axis=1))
    expected_loss = float(np.mean(log_z - logits[np.arange(len(labels)), labels]))
    final = r0["metrics"][-1]
    assert final["validation/loss"] == pytest.approx(expected_loss, rel=1e-5)
    expected_error = float(np.mean(logits.argmax(axis=1) != labels))
    assert final["validation/error"] == pytest.approx(expected_error, abs=1e-12)
