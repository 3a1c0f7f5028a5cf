"""The optimizer hyperparameters the step loop reads. Gradient clipping by global norm
(`grad_clip_norm`, read whatever the optimizer): the loop clips as a plain loop with the
clipping written by hand does, and reports the interval's mean gradient norm before clipping and
the fraction of steps clipped. AdamW's `beta2` and `eps`: an update computed by hand."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from service.analysis import curves
from service.core.errors import SpecError
from service.distributed import checkpoint
from service.distributed.topology import Topology
from service.study import spec
from service.study.sections import Curves
from service.trainer.loop import build_optimizer, train
from tests.helpers.studies import MINIMAL_STUDY
from tests.helpers.trainer_runs import HPARAMS, Reporter, make_plan, plain_loop_parts, read_log
from tests.helpers.two_branches import TwoBranches

CLIP = 0.37
STEPS, EVERY = 12, 4


def hand_clipped_run(plan, clip: float | None):
    """The trial's updates in a plain loop; the gradients' global norm computed in float64 with
    numpy and the gradients scaled by min(1, clip / (norm + 1e-6)) by hand. Returns the final
    weights and each step's norm before clipping."""
    workload, model, optimizer, stream = plain_loop_parts(plan)
    norms = []
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = float(plan.hparams["learning_rate"])
        batch = stream.batch(step)
        loss = workload.loss(model(batch["features"]), batch).mean()
        optimizer.zero_grad()
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = float(np.sqrt(sum((g.double().numpy() ** 2).sum() for g in grads)))
        norms.append(norm)
        if clip is not None and norm > clip:
            for g in grads:
                g.mul_(clip / (norm + 1e-6))
        optimizer.step()
    return model.state_dict(), norms


def clipped_plan(digits_dir, storage, clip):
    hparams = {**HPARAMS, **({"grad_clip_norm": clip} if clip is not None else {})}
    return make_plan(
        digits_dir,
        storage,
        hparams=hparams,
        max_train_steps=STEPS,
        eval_every_steps=EVERY,
        schedule={"kind": "constant"},
    )


def test_the_loop_clips_as_a_plain_loop_with_clipping_by_hand(digits_dir, tmp_path):
    plan = clipped_plan(digits_dir, tmp_path / "s", CLIP)
    reporter = Reporter(tmp_path)
    train(plan, Topology(), reporter)
    trained = checkpoint.load(reporter.reports[-1][1]).model

    expected, norms = hand_clipped_run(plan, CLIP)
    clipped = [n > CLIP for n in norms]
    assert 0 < sum(clipped) < len(clipped), norms  # the test sees clipped and unclipped steps
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-4, atol=1e-6)
    for m, lo in zip(reporter.metrics, range(0, STEPS, EVERY), strict=True):
        assert m["train/grad_norm"] == pytest.approx(np.mean(norms[lo : lo + EVERY]), rel=1e-4)
        assert m["train/clipped_fraction"] == pytest.approx(np.mean(clipped[lo : lo + EVERY]))

    unclipped, _ = hand_clipped_run(plan, None)
    assert any(not torch.allclose(trained[k], unclipped[k], rtol=1e-3) for k in unclipped)


def test_without_grad_clip_norm_nothing_is_clipped_and_the_norms_are_still_reported(digits_dir, tmp_path):
    """The clipping verdict's threshold needs the norms of a trial that does not clip: each
    interval's mean is the plain loop's (numpy, float64), and its clipped fraction 0."""
    plan = clipped_plan(digits_dir, tmp_path / "s", None)
    reporter = Reporter(tmp_path)
    train(plan, Topology(), reporter)
    expected, norms = hand_clipped_run(plan, None)
    trained = checkpoint.load(reporter.reports[-1][1]).model
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-4, atol=1e-6)
    assert len(reporter.metrics) == STEPS // EVERY
    means = [np.mean(norms[lo : lo + EVERY]) for lo in range(0, STEPS, EVERY)]
    for m, mean in zip(reporter.metrics, means, strict=True):
        assert m["train/grad_norm"] == pytest.approx(mean, rel=1e-4)
        assert m["train/clipped_fraction"] == 0.0
    # the clipping verdict, read from the trial's metrics log, suggests a threshold for it
    row = {"trial_name": "r1-0", "status": "FINISHED", "max_train_steps": STEPS}
    metric, mode = plan.study.training.metric, plan.study.training.mode
    found = {v.kind: v for v in curves.trial_verdicts(row, read_log(plan), metric, mode, Curves())}
    assert found["clipping"].facts["suggested_clip"] == pytest.approx(np.percentile(means, 90), rel=1e-4)
    assert found["clipping"].facts["clipped_share"] == 0.0 and not found["clipping"].is_warning
    assert "without gradient clipping" in found["clipping"].message


def study_with(**search):
    d = copy.deepcopy(MINIMAL_STUDY)
    d["search"].update(search)
    return d


@pytest.mark.parametrize("optimizer", ["sgd_momentum", "nesterov", "adamw"])
def test_grad_clip_norm_is_searchable_with_every_optimizer(optimizer):
    d = study_with(grad_clip_norm={"role": "nuisance", "min": 0.1, "max": 10, "scale": "log"})
    d["training"]["optimizer"] = optimizer
    assert spec.load_dict(d).search["grad_clip_norm"].max == 10


@pytest.mark.parametrize(
    "hp, message",
    [
        ({"role": "fixed", "value": 0}, "must be > 0 (got 0)"),
        ({"role": "nuisance", "min": -1, "max": 1}, "must be > 0 (got -1.0)"),
        ({"role": "fixed", "value": "big"}, "must be a number"),
    ],
)
def test_a_grad_clip_norm_that_is_no_norm_is_refused_naming_the_field(hp, message):
    with pytest.raises(SpecError, match=r"search\.grad_clip_norm") as e:
        spec.load_dict(study_with(grad_clip_norm=hp))
    assert message in str(e.value)


@pytest.mark.parametrize("beta2, eps", [(0.999, 1e-8), (0.95, 0.5)])
def test_adamw_reads_a_searched_beta2_and_eps(beta2, eps):
    """Two AdamW updates of one weight, by hand: m and v are bias-corrected EMAs of g and g²,
    the update lr * m̂ / (sqrt(v̂) + eps) (weight decay 0)."""
    w = torch.nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    opt = build_optimizer("adamw", [w], {"learning_rate": 0.1, "beta2": beta2, "eps": eps})
    expected, m, v, beta1 = 1.0, 0.0, 0.0, 0.9
    for t, g in enumerate([0.3, -0.2], start=1):
        w.grad = torch.tensor([g], dtype=torch.float64)
        opt.step()
        m, v = beta1 * m + (1 - beta1) * g, beta2 * v + (1 - beta2) * g * g
        expected -= 0.1 * (m / (1 - beta1**t)) / (np.sqrt(v / (1 - beta2**t)) + eps)
    assert float(w.detach()) == pytest.approx(expected, rel=1e-12)


def test_eps_is_refused_with_an_optimizer_that_does_not_read_it():
    with pytest.raises(SpecError, match=r"search\.eps: not read by optimizer nesterov \(only by adamw\)"):
        d = study_with(eps={"role": "fixed", "value": 1e-6})
        d["training"]["optimizer"] = "nesterov"
        spec.load_dict(d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["sgd_momentum", "nesterov", "adamw"])
def test_the_built_in_optimizers_update_as_torchs_per_parameter_loop(name, dtype):
    """The built-in optimizers take torch's foreach path on CPU too for float32 parameters (one
    call per group of tensors, not a Python call per parameter and operation) and update bit
    for bit as torch's per-parameter loop (`foreach=False`), with weight decay, a changing
    learning rate and a head left without a gradient on some steps. bf16 parameters, whose
    foreach arithmetic rounds otherwise, keep the per-parameter loop."""
    hparams = {"learning_rate": 0.05, "momentum": 0.9, "weight_decay": 0.01, "beta2": 0.99}
    weights = []
    for foreach in (True, False):
        torch.manual_seed(0)
        model = TwoBranches().to(dtype)
        optimizer = build_optimizer(name, model.parameters(), hparams)
        assert optimizer.param_groups[0]["foreach"] is (True if dtype == torch.float32 else None)
        if not foreach:
            for group in optimizer.param_groups:
                group["foreach"] = False
        data = torch.Generator().manual_seed(1)
        for step in range(9):
            x, y = torch.randn(8, 6, generator=data).to(dtype), torch.randint(0, 3, (8,), generator=data)
            for group in optimizer.param_groups:
                group["lr"] = 0.05 / (1 + step)
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x, "a" if step % 3 else "b"), y).backward()
            optimizer.step()
        weights.append([p.detach().clone() for p in model.parameters()])
    mine, loop = weights
    assert all(torch.equal(a, b) for a, b in zip(mine, loop, strict=True))
