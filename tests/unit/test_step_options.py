"""The step loop's options, each against a plain loop written by hand: mixed precision
(`training.precision`, bf16 and fp16 on CPU), gradient accumulation (`training.microbatch_size`),
`training.compile`, and the workload's parameter groups; resume stays bitwise with each."""

from __future__ import annotations

import math

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from service.distributed import checkpoint
from service.distributed.topology import Topology
from service.trainer import precision as amp
from service.trainer import setup
from service.trainer.loop import train
from service.workloads.digits import Digits
from tests.helpers import mlp_workload
from tests.helpers.trainer_runs import (
    HPARAMS,
    Interrupted,
    Reporter,
    make_plan,
    plain_loop_parts,
    without_timing,
)

STEPS, EVERY, BATCH = 8, 4, 32
MLP = "tests.helpers.mlp_workload:MLPDigits"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def plan_with(digits_dir, storage, hparams=None, **training):
    return make_plan(
        digits_dir,
        storage,
        hparams={**HPARAMS, **(hparams or {})},
        max_train_steps=STEPS,
        eval_every_steps=EVERY,
        batch_size=BATCH,
        schedule={"kind": "constant"},
        **training,
    )


def run(plan, store, **kw) -> Reporter:
    reporter = Reporter(store, **kw)
    try:
        train(plan, Topology(), reporter)
    except Interrupted:
        pass
    return reporter


def final_state(reporter: Reporter) -> checkpoint.TrialState:
    return checkpoint.load(reporter.reports[-1][1])


def hand_run(plan, precision="fp32", micro=None, clip=None, init_scale=2.0**16):
    """The trial's updates as a plain loop: autocast and GradScaler written out, the batch cut
    into microbatches by hand, each microbatch's mean loss divided by their number, the
    gradients unscaled before clipping. Returns the model, the scaler (fp16) or None, and each
    step's gradient norm before clipping."""
    workload, model, optimizer, stream = plain_loop_parts(plan)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale) if precision == "fp16" else None
    norms = []
    for step in range(STEPS):
        batch = stream.batch(step)
        optimizer.zero_grad()
        rows = micro or len(batch["label"])
        parts = [{k: v[i : i + rows] for k, v in batch.items()} for i in range(0, len(batch["label"]), rows)]
        for part in parts:
            with torch.autocast("cpu", dtype=DTYPES.get(precision), enabled=precision != "fp32"):
                loss = F.cross_entropy(model(part["features"]), part["label"]) / len(parts)
            (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is not None:
            scaler.unscale_(optimizer)
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        else:  # the global norm in float64 with numpy (inf when the fp16 gradients overflowed)
            grads = [p.grad.double().numpy() for p in model.parameters() if p.grad is not None]
            norms.append(float(np.sqrt(sum((g**2).sum() for g in grads))))
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
    return model, scaler, norms


def hand_validation_losses(model, digits_dir, precision) -> torch.Tensor:
    """Each validation example's cross-entropy in float64, the forward pass under the same
    autocast, ordered by example id."""
    table = pq.read_table(digits_dir / "validation")
    batch = Digits().to_batch(table)
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=DTYPES.get(precision), enabled=precision != "fp32"):
        losses = F.cross_entropy(model(batch["features"]), batch["label"], reduction="none")
    order = torch.from_numpy(table.column("example_id").to_numpy()).argsort()
    return losses.double()[order]


def logged_validation_losses(plan, step) -> torch.Tensor:
    """The loop's per-example validation losses at `step` (its predictions file), by example id."""
    rows = pq.read_table(plan.predictions_uri("validation", step)).sort_by("example_id")
    return torch.tensor(rows.column("metric/loss").to_numpy(), dtype=torch.float64)


def assert_weights_close(trained: dict, model, **tol):
    for name, value in model.state_dict().items():
        torch.testing.assert_close(trained[name], value, **tol)


def test_microbatches_equal_the_whole_batch_at_every_eval(digits_dir, tmp_path):
    whole = run(plan_with(digits_dir, tmp_path / "a", workload=MLP), tmp_path / "wa")
    mlp_workload.SEEN.clear()
    split = run(plan_with(digits_dir, tmp_path / "b", workload=MLP, microbatch_size=8), tmp_path / "wb")
    assert {rows for rows, _ in mlp_workload.SEEN} == {8}  # the forward passes really were microbatches
    assert len(mlp_workload.SEEN) == 4 * STEPS
    for a, b in zip(whole.metrics, split.metrics, strict=True):
        assert a["step"] == b["step"]
        for key in ("train/loss", "validation/loss", "validation/error"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    model, _, _ = hand_run(plan_with(digits_dir, tmp_path / "c", workload=MLP))  # whole batches, by hand
    assert_weights_close(final_state(split).model, model, rtol=1e-5, atol=1e-6)


def test_a_microbatch_that_does_not_split_the_worker_batch_is_refused_naming_the_field(digits_dir, tmp_path):
    from service.core.errors import SpecError

    with pytest.raises(SpecError, match=r"training\.microbatch_size: must divide the per-worker batch 32"):
        plan_with(digits_dir, tmp_path, microbatch_size=12)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_and_evaluates_as_a_plain_autocast_loop(digits_dir, tmp_path, precision):
    plan = plan_with(digits_dir, tmp_path / "s", precision=precision)
    reporter = run(plan, tmp_path)
    state = final_state(reporter)
    model, scaler, _ = hand_run(plan_with(digits_dir, tmp_path / "h", precision=precision), precision)
    assert_weights_close(state.model, model, rtol=1e-5, atol=1e-6)
    fp32_model, _, _ = hand_run(plan_with(digits_dir, tmp_path / "f"))
    assert any(not torch.allclose(state.model[k], v, rtol=1e-3) for k, v in fp32_model.state_dict().items())

    logged = logged_validation_losses(plan, STEPS)
    torch.testing.assert_close(
        logged, hand_validation_losses(model, digits_dir, precision), rtol=1e-6, atol=1e-7
    )
    fp32_eval = hand_validation_losses(model, digits_dir, "fp32")
    assert (logged - fp32_eval).abs().max() > 1e-5  # the eval really ran in `precision`
    assert reporter.metrics[-1]["validation/loss"] == pytest.approx(float(logged.mean()), rel=1e-12)
    if precision == "fp16":
        assert state.scaler == scaler.state_dict() and state.scaler["scale"] > 0
    else:
        assert state.scaler == {}


def test_fp16_clips_the_unscaled_gradients(digits_dir, tmp_path, monkeypatch):
    """From a loss scale that overflows the first updates: they are skipped, their norms left
    out of train/grad_norm; the others clip the unscaled gradients."""
    monkeypatch.setattr(amp, "INIT_SCALE", 2.0**22)
    plan = plan_with(
        digits_dir, tmp_path / "s", {"grad_clip_norm": 0.37}, precision="fp16", microbatch_size=16
    )
    reporter = run(plan, tmp_path)
    model, scaler, norms = hand_run(plan, "fp16", micro=16, clip=0.37, init_scale=2.0**22)
    assert_weights_close(final_state(reporter).model, model, rtol=1e-5, atol=1e-6)
    assert final_state(reporter).scaler == scaler.state_dict()
    assert not all(math.isfinite(n) for n in norms)  # the scaler skipped an overflowed update
    for m, lo in zip(reporter.metrics, range(0, STEPS, EVERY), strict=True):
        finite = [n for n in norms[lo : lo + EVERY] if math.isfinite(n)]
        assert m["train/grad_norm"] == pytest.approx(sum(finite) / len(finite), rel=1e-5)
        assert m["train/clipped_fraction"] == sum(n > 0.37 for n in finite) / EVERY


def test_fp16_without_clipping_reports_the_norms_of_the_updates_it_made(digits_dir, tmp_path, monkeypatch):
    """Without grad_clip_norm the loop still reports the unscaled gradients' norm: the mean of
    the finite ones (the overflowed updates skipped), nothing clipped."""
    monkeypatch.setattr(amp, "INIT_SCALE", 2.0**22)
    plan = plan_with(digits_dir, tmp_path / "s", precision="fp16")
    reporter = run(plan, tmp_path)
    model, _, norms = hand_run(plan, "fp16", init_scale=2.0**22)
    assert_weights_close(final_state(reporter).model, model, rtol=1e-5, atol=1e-6)
    assert not all(math.isfinite(n) for n in norms)  # the scaler skipped an overflowed update
    for m, lo in zip(reporter.metrics, range(0, STEPS, EVERY), strict=True):
        finite = [n for n in norms[lo : lo + EVERY] if math.isfinite(n)]
        if finite:
            assert m["train/grad_norm"] == pytest.approx(sum(finite) / len(finite), rel=1e-5)
        else:  # every update of the interval overflowed and was skipped
            assert math.isnan(m["train/grad_norm"])
        assert m["train/clipped_fraction"] == 0.0


OPTIONS = {
    "fp32": {},
    "bf16": {"precision": "bf16"},
    "fp16": {"precision": "fp16"},
    "microbatches": {"microbatch_size": 8},
    "clipping": {"hparams": {"grad_clip_norm": 0.37}},
    "all": {"precision": "fp16", "microbatch_size": 16, "hparams": {"grad_clip_norm": 0.37}},
}


@pytest.mark.parametrize("option", OPTIONS)
def test_resume_is_bitwise_with_each_step_option(digits_dir, tmp_path, option):
    """Interrupted after its first eval point and resumed from that checkpoint: the same
    metrics and the same final weights, optimizer and scaler state, to the bit."""
    whole = run(plan_with(digits_dir, tmp_path / "a", **OPTIONS[option]), tmp_path / "wa")
    first = run(plan_with(digits_dir, tmp_path / "b", **OPTIONS[option]), tmp_path / "wb", stop_after=1)
    resumed_from = checkpoint.load(first.reports[-1][1])
    rest = run(
        plan_with(digits_dir, tmp_path / "b", **OPTIONS[option]), tmp_path / "wc", restore_state=resumed_from
    )
    assert [without_timing(m) for m in first.metrics + rest.metrics] == [
        without_timing(m) for m in whole.metrics
    ]
    a, b = final_state(whole), final_state(rest)
    assert a.scaler == b.scaler and (a.scaler != {}) == ("fp16" in option or option == "all")
    for name, value in a.model.items():
        assert torch.equal(value, b.model[name]), name
    for param, s in a.optimizer["state"].items():
        assert all(torch.equal(v, b.optimizer["state"][param][k]) for k, v in s.items())


def test_compile_trains_the_same_model_under_the_same_checkpoint_keys(digits_dir, tmp_path, monkeypatch):
    """torch.compile's graph capture (dynamo) with the eager backend: inductor's code generation
    takes too long for a unit test on CPU (bench/gpu.py runs it on a GPU)."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(setup, "COMPILE_BACKEND", "eager")
    plain = final_state(run(plan_with(digits_dir, tmp_path / "a"), tmp_path / "wa"))
    counters.clear()
    compiled = final_state(run(plan_with(digits_dir, tmp_path / "b", compile=True), tmp_path / "wb"))
    assert counters["stats"]["calls_captured"] > 0  # the model's forward went through dynamo
    assert list(compiled.model) == list(plain.model)
    for name, value in plain.model.items():
        torch.testing.assert_close(compiled.model[name], value, rtol=1e-5, atol=1e-6)


def hand_sgd(plan, decay_norms_and_biases: bool) -> dict:
    """Plain SGD (momentum 0) written out: w -= lr * (grad + wd * w), the decay term left out for
    one-dimensional parameters (biases, LayerNorm's scale and shift) unless asked."""
    _, model, _, stream = plain_loop_parts(plan)
    lr, wd = plan.hparams["learning_rate"], plan.hparams["weight_decay"]
    for step in range(STEPS):
        batch = stream.batch(step)
        model.zero_grad()
        F.cross_entropy(model(batch["features"]), batch["label"]).backward()
        with torch.no_grad():
            for p in model.parameters():
                decay = wd if (p.ndim >= 2 or decay_norms_and_biases) else 0.0
                p -= lr * (p.grad + decay * p)
    return model.state_dict()


@pytest.mark.parametrize("workload, decays", [("MLPDigits", True), ("NoDecayMLPDigits", False)])
def test_the_workloads_param_groups_keep_weight_decay_off_norms_and_biases(
    digits_dir, tmp_path, workload, decays
):
    hparams = {"momentum": 0.0, "weight_decay": 0.5}
    plan = plan_with(
        digits_dir,
        tmp_path / "s",
        hparams,
        workload=f"tests.helpers.mlp_workload:{workload}",
        optimizer="sgd_momentum",
    )
    trained = final_state(run(plan, tmp_path)).model
    expected, other = hand_sgd(plan, decays), hand_sgd(plan, not decays)
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(trained["2.bias"], other["2.bias"], rtol=1e-3)  # the LayerNorm's shift


class Groups(mlp_workload.MLPDigits):
    """A workload whose param_groups are given per test."""

    def __init__(self, groups):
        self.groups = groups

    def param_groups(self, model, hparams):
        return self.groups(model)


@pytest.mark.parametrize(
    "groups, message",
    [
        (lambda m: [{"params": list(m.parameters())[:-1]}], r"param_groups: leaves out 1 of the model's 6"),
        (lambda m: [{"params": list(m.parameters()), "lr": 1.0}], r"param_groups\[0\] sets lr"),
        (
            lambda m: [{"params": list(m.parameters()), "weight_decy": 0}],
            r"param_groups\[0\] sets \['weight_decy'\]",
        ),
        (
            lambda m: [{"params": list(m.parameters()), "weight_decay": 0.0}],
            r"param_groups: every group sets weight_decay, so weight_decay reaches no parameter",
        ),
    ],
)
def test_param_groups_that_would_lose_a_parameter_or_a_hyperparameter_are_refused(groups, message):
    from service.core.errors import PlaybookError
    from service.trainer.optimizers import workload_optimizer

    workload = Groups(groups)
    model = workload.build_model({"width": 4})
    with pytest.raises(PlaybookError, match=rf"^workload mlp_digits: {message}"):
        workload_optimizer("nesterov", workload, model, {"learning_rate": 0.1, "weight_decay": 0.1})


def test_the_fast_paths_async_checkpoints_keep_the_scaler(digits_dir, tmp_path):
    """The single-worker fast path saves through AsyncCheckpointer (a snapshot of the state):
    its last checkpoint holds the same fp16 scaler state as the reporter's."""
    from service.distributed.checkpoint_store import AsyncCheckpointer, CheckpointStore

    reported = final_state(run(plan_with(digits_dir, tmp_path / "a", precision="fp16"), tmp_path / "wa"))
    store = CheckpointStore(str(tmp_path / "store"), 2, "validation/loss", "min")
    plan = plan_with(digits_dir, tmp_path / "b", precision="fp16")
    train(plan, Topology(), Reporter(tmp_path / "wb"), checkpointer=AsyncCheckpointer(store))
    saved = store.latest_state()
    assert saved.step == STEPS and saved.scaler == reported.scaler != {}


def test_a_workloads_own_optimizer_is_used_with_the_searched_hyperparameters(digits_dir, tmp_path):
    """`training.optimizer: workload` with Adagrad, against Adagrad written by hand:
    g += wd * w; s += g²; w -= lr * g / (sqrt(s) + eps)."""
    plan = make_plan(
        digits_dir,
        tmp_path / "s",
        hparams={"learning_rate": 0.1, "width": 4, "eps": 0.05, "weight_decay": 0.01},  # no momentum
        workload="tests.helpers.mlp_workload:AdagradMLPDigits",
        optimizer="workload",
        max_train_steps=STEPS,
        eval_every_steps=EVERY,
        batch_size=BATCH,
        schedule={"kind": "constant"},
    )
    trained = final_state(run(plan, tmp_path)).model
    _, model, _, stream = plain_loop_parts(plan)
    sums = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    for step in range(STEPS):
        batch = stream.batch(step)
        model.zero_grad()
        F.cross_entropy(model(batch["features"]), batch["label"]).backward()
        with torch.no_grad():
            for name, p in model.named_parameters():
                g = p.grad + 0.01 * p
                sums[name] += g * g
                p -= 0.1 * g / (sums[name].sqrt() + 0.05)
    assert_weights_close(trained, model, rtol=1e-5, atol=1e-6)


def test_a_workloads_own_optimizer_that_ignores_a_set_hyperparameter_is_refused():
    from service.core.errors import PlaybookError
    from service.trainer.optimizers import workload_optimizer

    workload = mlp_workload.DecayBlindMLPDigits()
    model = workload.build_model({"width": 4})
    with pytest.raises(PlaybookError, match=r"^workload mlp_digits: optimizer: does not read weight_decay"):
        workload_optimizer("workload", workload, model, {"learning_rate": 0.1, "weight_decay": 0.1})


def test_optimizer_workload_lets_search_set_any_optimizer_hyperparameter():
    import copy

    from service.study import spec
    from tests.helpers.studies import MINIMAL_STUDY

    d = copy.deepcopy(MINIMAL_STUDY)
    d["training"]["optimizer"] = "workload"
    d["search"].update(momentum={"role": "fixed", "value": 0.9}, eps={"role": "fixed", "value": 1e-6})
    assert spec.load_dict(d).training.optimizer == "workload"
