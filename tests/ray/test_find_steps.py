"""The max_train_steps finder: choosing from a constant-LR sweep (pure), and a real sweep on
digits that returns a step count and refuses a grid whose fastest learning rate is at an edge."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import yaml

from service.cli import main
from service.core.errors import SpecError
from service.planning.find_steps import choose, first_fit_step, sweep_study
from service.study import spec
from service.workloads.digits import Digits
from tests.helpers.studies import digits_logits, study_dict


def test_first_fit_step_is_the_first_eval_whose_training_sample_fits():
    """The fit is read from the training sample evaluated in eval mode (train_eval/loss), not
    from the running mean of minibatch losses (train/loss), which here fits earlier."""
    history = [
        {"step": 10, "train/loss": 0.4, "train_eval/loss": 0.9},
        {"step": 20, "train/loss": 0.3, "train_eval/loss": 0.5},
        {"step": 30, "train/loss": 0.2, "train_eval/loss": 0.2},
        {"step": 40, "train/loss": 0.1, "train_eval/loss": 0.1},
    ]
    assert first_fit_step(history, 0.5) == 20
    assert first_fit_step(history, 0.05) is None
    assert first_fit_step([{"step": 10, "train_eval/loss": None, "status": "diverged"}], 1.0) is None


def test_choose_takes_the_fastest_interior_learning_rate():
    found = choose({0.01: 300, 0.1: 120, 1.0: 200}, 400, 0.3)
    assert found.ok and found.max_train_steps == 120 and found.learning_rate == 0.1
    assert found.fit_steps == ((0.01, 300), (0.1, 120), (1.0, 200))


@pytest.mark.parametrize(
    "fits,side", [({0.01: 100, 0.1: 200, 1.0: None}, "below"), ({0.01: None, 0.1: 200, 1.0: 90}, "above")]
)
def test_choose_refuses_an_edge(fits, side):
    found = choose(fits, 400, 0.3)
    assert not found.ok and found.max_train_steps is None
    assert f"extend find_steps.learning_rates {side}" in found.message


def test_choose_refuses_when_nothing_fits():
    found = choose({0.01: None, 0.1: None, 1.0: None}, 400, 0.3)
    assert not found.ok and "within 400 steps" in found.message


def test_sweep_study_is_a_constant_lr_grid_without_regularisation(digits_dir, tmp_path):
    """Digits declares dropout (a regulariser) and augment (augmentation): whether searched
    or fixed on in the study, the sweep turns them off, as it does weight decay."""
    raw = study_dict(
        digits_dir,
        tmp_path,
        find_steps={"learning_rates": [0.01, 0.1, 1.0], "max_train_steps": 50, "train_loss_threshold": 0.4},
    )
    raw["search"]["weight_decay"] = {"role": "nuisance", "min": 1e-5, "max": 1e-3, "scale": "log"}
    raw["search"]["dropout"] = {"role": "nuisance", "min": 0.1, "max": 0.5}
    raw["search"]["augment"] = {"role": "fixed", "value": True}
    sweep = sweep_study(spec.load_dict(raw))
    assert sweep.name == "t-find-steps" and sweep.rounds[0].kind == "grid"
    assert sweep.training.schedule.kind == "constant" and sweep.training.max_train_steps == 50
    assert sweep.search["learning_rate"].values == (0.01, 0.1, 1.0)
    assert sweep.search["weight_decay"].value == 0.0
    assert sweep.search["dropout"].role == "fixed" and sweep.search["dropout"].value == 0.0
    assert sweep.search["augment"].value is False
    assert sweep.search["momentum"].value == pytest.approx((0.5 + 0.95) / 2)
    assert sweep.training.train_eval_sample_size == 2048  # the find_steps default
    spec.load_dict(spec.to_dict(sweep))  # a valid study in its own right


class LabelSmoothingDigits(Digits):
    """A workload of the user's declaring a regulariser the study does not mention."""

    hparam_defaults = {**Digits.hparam_defaults, "label_smoothing": 0.1}
    regularizers = {**Digits.regularizers, "label_smoothing": 0.0}


class UndeclaredDigits(Digits):
    regularizers = {"mixup": 0.0}


def test_sweep_turns_off_every_declared_switch_and_refuses_an_unknown_one(digits_dir, tmp_path):
    fs = {"learning_rates": [0.01, 0.1, 1.0], "max_train_steps": 50, "train_loss_threshold": 0.4}
    raw = study_dict(digits_dir, tmp_path, find_steps=fs, workload=f"{__name__}:LabelSmoothingDigits")
    sweep = sweep_study(spec.load_dict(raw))
    fixed = {k: hp.value for k, hp in sweep.search.items() if k != "learning_rate"}
    assert fixed == {
        "momentum": pytest.approx((0.5 + 0.95) / 2),
        "width": 4,
        "weight_decay": 0.0,
        "dropout": 0.0,
        "label_smoothing": 0.0,
        "augment": False,
    }
    raw["workload"] = f"{__name__}:UndeclaredDigits"
    with pytest.raises(SpecError, match="declares regularizer/augmentation 'mixup'"):
        sweep_study(spec.load_dict(raw))


def write_study(digits_dir, tmp_path, name, lrs) -> str:
    raw = study_dict(
        digits_dir,
        tmp_path / "storage",
        name=name,
        find_steps={
            "learning_rates": lrs,
            "max_train_steps": 150,
            "train_loss_threshold": 0.7,
            "eval_every_steps": 25,
        },
    )
    raw["search"]["width"] = {"role": "fixed", "value": 8}
    # Regularisation and augmentation on in the study: the sweep must run without them.
    raw["search"]["dropout"] = {"role": "nuisance", "min": 0.2, "max": 0.5}
    raw["search"]["augment"] = {"role": "fixed", "value": True}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def last_checkpoint(trial_dir):
    from service.distributed import checkpoint

    folders = [p for p in trial_dir.iterdir() if p.name.startswith("checkpoint") and p.is_dir()]
    return max((checkpoint.load(str(p)) for p in folders), key=lambda s: s.step)


@pytest.mark.ray
def test_find_steps_on_digits(ray_cluster, digits_dir, tmp_path, capsys):
    good = write_study(digits_dir, tmp_path, "fs-good", [0.003, 0.1, 10.0])
    assert main(["find-steps", good]) == 0
    out = capsys.readouterr().out
    stored = json.loads((tmp_path / "storage" / "fs-good-find-steps" / "find_steps.json").read_text())
    assert stored["ok"] and stored["learning_rate"] == 0.1
    assert f"initial max_train_steps: {stored['max_train_steps']}" in out
    # The answer is the first eval at which lr=0.1's training-sample loss is at or below the
    # threshold, read here from its metrics log; and no other learning rate got there earlier.
    trials = tmp_path / "storage" / "fs-good-find-steps" / "trials"
    logs = {}
    for trial in ("sweep-0000", "sweep-0001", "sweep-0002"):
        path = trials / trial / "metrics.jsonl"
        logs[trial] = [json.loads(line) for line in path.read_text().splitlines()]

    def fit(log):
        return next(
            (r["step"] for r in log if r.get("train_eval/loss") is not None and r["train_eval/loss"] <= 0.7),
            math.inf,
        )

    assert stored["max_train_steps"] == fit(logs["sweep-0001"]) == min(fit(v) for v in logs.values())
    # train_eval/loss is the loss of the whole training split (fewer rows than the sample
    # size) under the trial's weights in eval mode, computed here with numpy from its last
    # checkpoint; and that trial ran with dropout and augmentation off.
    final = last_checkpoint(trials / "sweep-0001")
    assert final.hparams["dropout"] == 0.0 and final.hparams["augment"] is False
    logits, labels = digits_logits(final, digits_dir / "train")
    top = logits.max(axis=1)
    log_z = top + np.log(np.exp(logits - top[:, None]).sum(axis=1))
    expected = float(np.mean(log_z - logits[np.arange(len(labels)), labels]))
    last = logs["sweep-0001"][-1]
    assert last["step"] == final.step == 150 and last["train_eval/count"] == len(labels)
    assert last["train_eval/loss"] == pytest.approx(expected, rel=1e-5)

    edge = write_study(digits_dir, tmp_path, "fs-edge", [0.01, 0.03, 0.1])
    assert main(["find-steps", edge]) == 1
    assert "is at the edge of the grid; extend find_steps.learning_rates above" in capsys.readouterr().err


def test_digits_switches_do_what_they_declare():
    """Off by default (the model and its state keys as before); `augment` moves each training
    image by at most a pixel per axis (one of the 9 zero-filled shifts, worked out with numpy)
    and nothing in eval mode; `dropout` adds dropout before the head."""
    from torch import nn

    from service.workloads.digits import SmallConvNet

    workload = Digits()
    assert workload.regularizers == {"dropout": 0.0} and workload.augmentation == {"augment": False}
    assert list(workload.build_model({"width": 4}).state_dict()) == list(SmallConvNet(10, 4).state_dict())
    model = workload.build_model({"width": 4, "augment": True, "dropout": 0.5})
    assert isinstance(model.dropout, nn.Dropout) and model.dropout.p == 0.5
    x = torch.rand(64, 1, 8, 8)
    shifted = model.augment(x).numpy()
    seen = set()
    for image, out in zip(x.numpy()[:, 0], shifted[:, 0], strict=True):
        padded = np.pad(image, 1)
        shifts = [
            (a, b) for a in range(3) for b in range(3) if np.array_equal(out, padded[a : a + 8, b : b + 8])
        ]
        assert shifts
        seen.add(shifts[0])
    assert len(seen) > 1
    model.eval()
    assert torch.equal(model.augment(x), x)
