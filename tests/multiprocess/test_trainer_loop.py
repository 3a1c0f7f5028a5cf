"""The single-process step loop: step count, eval points, metrics, resume, divergence, checkpoints."""

from __future__ import annotations

import copy
import json
import math
import os
import pickle
import random

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from sklearn.metrics import zero_one_loss
from torch import nn

from service.distributed import checkpoint
from service.distributed.checkpoint import TrialState
from service.distributed.topology import Topology
from service.planning.trial import TrialPlan
from service.trainer.loop import train
from service.workloads.digits import Digits, SmallConvNet
from tests.helpers.trainer_runs import (
    HPARAMS,
    Interrupted,
    Reporter,
    make_plan,
    plain_loop_parts,
    read_log,
    without_timing,
)


@pytest.fixture(scope="module")
def adamw_run(digits_dir, tmp_path_factory):
    """One uninterrupted 70-step run (AdamW, so its state counts the optimizer updates)."""
    tmp = tmp_path_factory.mktemp("adamw_run")
    plan = make_plan(
        digits_dir, tmp / "storage", hparams={**HPARAMS, "learning_rate": 0.01}, optimizer="adamw"
    )
    reporter = Reporter(tmp)
    summary = train(plan, Topology(), reporter)
    return plan, reporter, summary


def test_runs_exactly_max_steps_and_reports_at_eval_points(adamw_run):
    plan, reporter, summary = adamw_run

    steps = [m["step"] for m in reporter.metrics]
    assert steps == [30, 60, 70]
    assert [m["status"] for m in reporter.metrics] == ["running", "running", "finished"]
    assert all(d is not None for _, d in reporter.reports)
    assert summary["last_step"] == 70 and summary["status"] == "finished"

    # Exactly 70 optimizer updates and 70 training-mode forward passes, counted independently
    # of the loop: AdamW's per-parameter step counter and BatchNorm's num_batches_tracked.
    final = checkpoint.load(reporter.reports[-1][1])
    assert final.step == 70
    adam_steps = {float(s["step"]) for s in final.optimizer["state"].values()}
    assert adam_steps == {70.0}
    tracked = [v.item() for k, v in final.model.items() if k.endswith("num_batches_tracked")]
    assert tracked and set(tracked) == {70}

    # The metrics log has one row per evaluation, the same rows that were reported.
    log = read_log(plan)
    assert [r["step"] for r in log] == [30, 60, 70]
    for row, reported in zip(log, reporter.metrics, strict=True):
        for key in ("learning_rate", "train/loss", "validation/loss", "validation/error"):
            assert row[key] == reported[key]

    # best_step / best_metric: the lowest validation/error so far, the latest on a tie.
    for i, reported in enumerate(reporter.metrics):
        so_far = reporter.metrics[: i + 1]
        best = so_far[0]
        for m in so_far[1:]:
            if m["validation/error"] <= best["validation/error"]:
                best = m
        assert reported["best_step"] == best["step"]
        assert reported["best_metric"] == best["validation/error"]


def test_validation_metrics_match_independent_evaluation(adamw_run, digits_dir):
    plan, reporter, _ = adamw_run
    final_metrics, final_dir = reporter.reports[-1]

    model = Digits().build_model(plan.hparams)
    model.load_state_dict(checkpoint.load(final_dir).model)
    model.eval()

    table = pq.read_table(str(digits_dir / "validation"), columns=["pixels", "label"])
    pixels = np.asarray(table.column("pixels").to_pylist(), dtype=np.float32)
    labels = table.column("label").to_numpy()
    assert len(labels) == 270
    with torch.no_grad():
        logits = model(torch.from_numpy(pixels).view(-1, 1, 8, 8)).double().numpy()

    top = logits.max(axis=1)
    log_z = top + np.log(np.exp(logits - top[:, None]).sum(axis=1))
    expected_loss = float(np.mean(log_z - logits[np.arange(len(labels)), labels]))
    expected_error = zero_one_loss(labels, logits.argmax(axis=1))

    assert final_metrics["validation/loss"] == pytest.approx(expected_loss, rel=1e-5)
    assert final_metrics["validation/error"] == pytest.approx(expected_error, abs=1e-12)
    # Sanity: the model learned something, so the comparison is not between two constants.
    assert expected_error < 0.8


@pytest.mark.parametrize("workload_class", ["DropoutDigits", "HostRngDigits"])
def test_resume_matches_uninterrupted_run(digits_dir, tmp_path, workload_class):
    """Dropout draws from torch's generator, HostRngDigits from numpy's and Python's: resume
    restores each."""
    workload = f"tests.helpers.rng_workloads:{workload_class}"
    storage = tmp_path / "storage"

    plan_a = make_plan(digits_dir, storage, "r1-0", workload=workload)
    run_a = Reporter(tmp_path / "a")
    train(plan_a, Topology(), run_a)

    # Run B: preempted right after its first checkpoint (step 30) ...
    plan_b = make_plan(digits_dir, storage, "r1-1", workload=workload)
    first = Reporter(tmp_path / "b1", stop_after=1)
    with pytest.raises(Interrupted):
        train(plan_b, Topology(), first)
    assert [m["step"] for m in first.metrics] == [30]
    # ... and restarted in a new train() call from that checkpoint, with a different global
    # RNG state than the one saved (as a fresh process would have).
    torch.manual_seed(12345)
    np.random.seed(12345)
    random.seed(12345)
    resumed = Reporter(tmp_path / "b2", restore_state=checkpoint.load(first.reports[0][1]))
    summary = train(plan_b, Topology(), resumed)

    assert summary["last_step"] == 70
    assert [m["step"] for m in resumed.metrics] == [60, 70]
    assert [without_timing(m) for m in resumed.metrics] == [without_timing(m) for m in run_a.metrics[1:]]
    assert [without_timing(r) for r in read_log(plan_b)] == [without_timing(r) for r in read_log(plan_a)]

    final_a = checkpoint.load(run_a.reports[-1][1])
    final_b = checkpoint.load(resumed.reports[-1][1])
    assert final_a.model.keys() == final_b.model.keys()
    for key in final_a.model:
        assert torch.equal(final_a.model[key], final_b.model[key]), key
    for pid, state in final_a.optimizer["state"].items():
        for name, value in state.items():
            assert torch.equal(value, final_b.optimizer["state"][pid][name]), (pid, name)


def test_nan_loss_ends_trial_as_diverged(digits_dir, tmp_path):
    hparams = {**HPARAMS, "learning_rate": 1e30}
    plan = make_plan(
        digits_dir,
        tmp_path / "storage",
        hparams=hparams,
        max_train_steps=40,
        eval_every_steps=10,
        schedule={"kind": "constant"},
    )
    reporter = Reporter(tmp_path)
    summary = train(plan, Topology(), reporter)

    last, last_dir = reporter.reports[-1]
    assert last["status"] == "diverged"
    # The step of the first non-finite loss, found here by replaying the same run step by step.
    assert last["diverged_at_step"] == first_nonfinite_step(plan)
    assert last["validation/error"] == math.inf  # the worst value for mode: min
    assert last_dir is None
    # The trial stops at the first evaluation point after the bad step; no further training.
    assert all(m["status"] == "running" for m in reporter.metrics[:-1])
    assert last["step"] < 40
    assert summary["status"] == "diverged" and summary["last_step"] == last["step"]
    log = read_log(plan)
    assert [r["step"] for r in log] == [m["step"] for m in reporter.metrics]
    assert log[-1]["status"] == "diverged"


def test_checkpoint_round_trip(tmp_path):
    torch.manual_seed(0)
    model = SmallConvNet(10, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x, y = torch.rand(16, 1, 8, 8), torch.randint(0, 10, (16,))

    def step(m, o):
        loss = nn.functional.cross_entropy(m(x), y)
        o.zero_grad()
        loss.backward()
        o.step()

    for _ in range(3):
        step(model, opt)
    other_rank_rng = torch.Generator().manual_seed(7).get_state()
    history = [
        {"step": 2, "validation/error": 0.5, "status": "running"},
        {"step": 3, "validation/error": math.inf, "status": "diverged"},
    ]
    state = TrialState(
        3,
        copy.deepcopy(model.state_dict()),
        copy.deepcopy(opt.state_dict()),
        [torch.get_rng_state(), other_rank_rng],
        copy.deepcopy(history),
    )
    expected_draw = torch.rand(5)
    directory = tmp_path / "ckpt"
    checkpoint.save(state, str(directory), {"validation/error": 0.5})

    assert sorted(os.listdir(directory)) == ["manifest.json", "meta.json", "state.pt"]  # no partial file
    with open(directory / "meta.json") as f:
        assert json.load(f) == {"step": 3, "metrics": {"validation/error": 0.5}}

    loaded = checkpoint.load(str(directory))
    assert loaded.step == 3
    assert loaded.history == history
    assert len(loaded.rng_states) == 2
    assert torch.equal(loaded.rng_states[1], other_rank_rng)
    torch.set_rng_state(loaded.rng_states[0])
    assert torch.equal(torch.rand(5), expected_draw)

    # A fresh model and optimizer restored from the checkpoint continue exactly like the original.
    restored = SmallConvNet(10, 4)
    restored.load_state_dict(loaded.model)
    restored_opt = torch.optim.AdamW(restored.parameters(), lr=0.01)
    restored_opt.load_state_dict(loaded.optimizer)
    step(model, opt)
    step(restored, restored_opt)
    for (name, a), b in zip(model.state_dict().items(), restored.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def _touch(path):
    with open(path, "w") as f:
        f.write("code ran")


class Payload:
    """A pickled object that runs code when unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return _touch, (self.path,)


def test_checkpoint_load_refuses_pickled_code(tmp_path):
    directory = tmp_path / "evil"
    directory.mkdir()
    marker = tmp_path / "marker"
    payload = {
        "format": checkpoint.FORMAT_VERSION,
        "step": 1,
        "model": {},
        "optimizer": {},
        "rng_states": [],
        "history": [Payload(str(marker))],
    }
    torch.save(payload, directory / checkpoint.STATE_FILE)
    checkpoint.write_manifest(str(directory))  # committed: only weights_only stands in the way
    with pytest.raises(pickle.UnpicklingError):
        checkpoint.load(str(directory))
    assert not marker.exists()


def test_checkpoint_load_rejects_other_format(tmp_path):
    directory = tmp_path / "old"
    directory.mkdir()
    torch.save(
        {"format": 0, "step": 1, "model": {}, "optimizer": {}, "rng_states": [], "history": []},
        directory / checkpoint.STATE_FILE,
    )
    checkpoint.write_manifest(str(directory))
    with pytest.raises(ValueError, match="format 0"):
        checkpoint.load(str(directory))


@pytest.mark.parametrize("ghost", [False, True])
def test_ghost_batch_norm_is_what_the_loop_trains_with(digits_dir, tmp_path, ghost):
    """After one step, the first BN layer's running mean is the per-virtual-batch update of the
    first batch's conv features (ghost) or the whole-batch update (plain), computed by hand."""
    from service.data.files import list_files
    from service.data.loader import TrainStream
    from service.data.sharding import train_shard
    from service.distributed.topology import data_seed, init_seed

    plan = make_plan(
        digits_dir,
        tmp_path / "s",
        max_train_steps=1,
        eval_every_steps=1,
        ghost_batch_norm=ghost,
        virtual_batch_size=8,
        schedule={"kind": "constant"},
    )
    reporter = Reporter(tmp_path)
    train(plan, Topology(), reporter)
    trained = checkpoint.load(reporter.reports[-1][1]).model["features.1.running_mean"]

    torch.manual_seed(init_seed(0))
    model = Digits().build_model(HPARAMS)
    workload = Digits()
    stream = TrainStream(
        workload,
        train_shard(list_files(str(digits_dir / "train")), 1, 0, 1, 0),
        32,
        data_seed(0, 0, 0),
        shuffle_window_bytes=plan.study.input.shuffle_window_mb << 20,  # the study's windows
    )
    with torch.no_grad():
        conv = model.features[0](stream.batch(0)["features"]).double()
    running = np.zeros(conv.shape[1])
    chunks = torch.split(conv, 8) if ghost else [conv]
    for chunk in chunks:
        running = 0.9 * running + 0.1 * chunk.mean(dim=(0, 2, 3)).numpy()
    np.testing.assert_allclose(trained.double().numpy(), running, rtol=1e-5, atol=1e-6)


def test_saved_predictions_reproduce_the_reported_metrics(digits_dir, tmp_path):
    """The predictions parquet alone gives back the reported error and per-class counts."""
    from sklearn.metrics import precision_recall_fscore_support

    plan = make_plan(
        digits_dir, tmp_path / "s", max_train_steps=30, eval_every_steps=15, eval_batch_size=100
    )  # 270 rows: the last eval batch is padded
    reporter = Reporter(tmp_path)
    train(plan, Topology(), reporter)
    log = read_log(plan)
    val_ids = pq.read_table(str(digits_dir / "validation")).column("example_id").to_numpy()
    for row in log:
        preds = pq.read_table(plan.predictions_uri("validation", row["step"])).to_pandas()
        assert sorted(preds["example_id"]) == sorted(val_ids)
        assert (preds["weight"] == 1).all() and (preds["step"] == row["step"]).all()
        assert (preds["split"] == "validation").all()
        error = float((preds["prediction"] != preds["label"]).mean())
        assert row["validation/error"] == pytest.approx(error, abs=1e-12)
        assert row["validation/count"] == len(val_ids)
        precision, recall, _, support = precision_recall_fscore_support(
            preds["label"], preds["prediction"], labels=list(range(10)), zero_division=np.nan
        )
        for c, report in enumerate(row["validation/per_class"]):
            assert report["support"] == support[c]
            assert report["recall"] == pytest.approx(recall[c])
            if not np.isnan(precision[c]):
                assert report["precision"] == pytest.approx(precision[c])
            assert report["recall_per_example"] == pytest.approx(1 / support[c])
            low, high = report["recall_interval"]
            assert low <= report["recall"] <= high


def first_nonfinite_step(plan: TrialPlan) -> int:
    """Replay the trial's updates in a plain loop (same seeds, data and optimizer) and return the
    1-based step whose loss is first non-finite."""
    workload, model, optimizer, stream = plain_loop_parts(plan)
    for step in range(plan.max_train_steps or plan.study.training.max_train_steps):
        for group in optimizer.param_groups:
            group["lr"] = float(plan.hparams["learning_rate"])
        batch = stream.batch(step)
        loss = workload.loss(model(batch["features"]), batch).mean()
        if not math.isfinite(loss.item()):
            return step + 1
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    raise AssertionError("the replay never diverged")


class StepCountingDigits(Digits):
    """Digits that counts the training steps it has begun (training-mode forwards) and keeps
    each step's per-example losses as tensors (no read back to the host)."""

    name = "step_counting_digits"
    steps_begun = 0
    losses: list = []

    def forward(self, model, batch):
        if model.training:
            StepCountingDigits.steps_begun += 1
        return model(batch["features"])

    def loss(self, outputs, batch):
        per_example = super().loss(outputs, batch)
        StepCountingDigits.losses.append(per_example.detach().clone())
        return per_example


HOST_READS = ("item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__")
"""Tensor methods that copy a tensor's values to the host (a device sync on CUDA)."""


def test_steps_between_eval_points_read_nothing_back_to_the_host(digits_dir, tmp_path, monkeypatch):
    """Every host read of a tensor on the training thread is recorded with the number of the
    step begun last: between eval points (steps 10, 20, 25) there must be none. The interval's
    train/loss is still the mean of its steps' losses."""
    import threading

    reads: list[tuple[int, str]] = []

    def recording(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if threading.current_thread() is threading.main_thread():
                reads.append((StepCountingDigits.steps_begun, name))
            return original(self, *args, **kwargs)

        return read

    StepCountingDigits.steps_begun, StepCountingDigits.losses = 0, []
    plan = make_plan(
        digits_dir,
        tmp_path / "s",
        workload=f"{__name__}:StepCountingDigits",
        max_train_steps=25,
        eval_every_steps=10,
    )
    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, recording(name))
    reporter = Reporter(tmp_path)
    train(plan, Topology(), reporter)
    monkeypatch.undo()

    assert StepCountingDigits.steps_begun == 25
    eval_points = {10, 20, 25}
    assert [m["step"] for m in reporter.metrics] == sorted(eval_points)
    in_steps = sorted({(step, name) for step, name in reads if step not in eval_points | {0}})
    assert in_steps == []
    assert {step for step, _ in reads} & eval_points == eval_points  # the tally is read there
    step_losses = [float(t.mean()) for t in StepCountingDigits.losses]
    for m, (lo, hi) in zip(reporter.metrics, [(0, 10), (10, 20), (20, 25)], strict=True):
        assert m["train/loss"] == pytest.approx(sum(step_losses[lo:hi]) / (hi - lo), rel=1e-12)


def test_train_eval_is_the_fixed_training_sample_in_eval_mode(digits_dir, tmp_path):
    """training.train_eval_sample_size: at every eval point, train_eval/loss and /error are those
    of the same fixed training sample under the weights of that step in eval mode, computed here
    with numpy from the checkpoint over the sampled rows (file order), read with pyarrow."""
    from service.evaluation.bias import fixed_sample

    plan = make_plan(
        digits_dir, tmp_path / "s", max_train_steps=20, eval_every_steps=10, train_eval_sample_size=100
    )
    reporter = Reporter(tmp_path)
    train(plan, Topology(), reporter)

    table = pq.read_table(str(digits_dir / "train"), columns=["pixels", "label"])
    rows = fixed_sample(table.num_rows, 100, plan.study.training.seed)
    pixels = np.asarray(table.column("pixels").to_pylist(), dtype=np.float32)[rows]
    labels = table.column("label").to_numpy()[rows]
    assert len(set(rows)) == 100
    for metrics, folder in reporter.reports:
        model = Digits().build_model(plan.hparams)
        model.load_state_dict(checkpoint.load(folder).model)
        model.eval()
        with torch.no_grad():
            logits = model(torch.from_numpy(pixels).view(-1, 1, 8, 8)).double().numpy()
        top = logits.max(axis=1)
        log_z = top + np.log(np.exp(logits - top[:, None]).sum(axis=1))
        assert metrics["train_eval/count"] == 100
        assert metrics["train_eval/loss"] == pytest.approx(
            float(np.mean(log_z - logits[np.arange(100), labels])), rel=1e-5
        )
        assert metrics["train_eval/error"] == pytest.approx(
            zero_one_loss(labels, logits.argmax(axis=1)), abs=1e-12
        )
    log = read_log(plan)
    assert [r["train_eval/loss"] for r in log] == [m["train_eval/loss"] for m, _ in reporter.reports]


class NanOnRankDigits(Digits):
    """Digits whose training loss is NaN on world rank 1 from its 7th step on."""

    name = "nan_on_rank_digits"
    steps = 0

    def loss(self, outputs, batch):
        import torch.distributed as dist

        per_example = super().loss(outputs, batch)
        NanOnRankDigits.steps += 1
        if dist.get_rank() == 1 and NanOnRankDigits.steps >= 7:
            per_example = per_example * math.nan
        return per_example


def nan_rank(rank, world_size, digits_dir, storage):
    plan = make_plan(
        digits_dir, storage, workload=f"{__name__}:NanOnRankDigits", max_train_steps=30, eval_every_steps=10
    )
    topo = Topology(world_rank=rank, world_size=world_size, local_rank=rank, workers_per_host=world_size)
    reporter = Reporter(None)
    reporter.report = lambda metrics, _dir: reporter.reports.append((metrics, None))
    summary = train(plan, topo, reporter)
    return [(m["step"], m["status"], m.get("diverged_at_step")) for m in reporter.metrics] + [
        summary["status"]
    ]


def test_divergence_on_one_rank_is_agreed_by_all_at_its_first_bad_step(digits_dir, tmp_path):
    """Rank 1's loss is NaN from step 7 (rank 0's from step 8, once the NaN gradients are
    averaged into its weights): both ranks stop at the eval point of step 10 with
    diverged_at_step 7, the first non-finite step over all ranks."""
    from tests.helpers.gloo import run_gloo

    results = run_gloo(nan_rank, 2, tmp_path, digits_dir, str(tmp_path / "storage"))
    assert results[0] == results[1] == [(10, "diverged", 7), "diverged"]
