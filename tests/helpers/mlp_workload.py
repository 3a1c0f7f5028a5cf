"""Test workloads without BatchNorm and without randomness in the forward pass (loaded as
`tests.helpers.mlp_workload:MLPDigits` / `:NoDecayMLPDigits`): an MLP with a LayerNorm on the
digits pixels, so a batch's gradients are the same whole or cut into microbatches (to float
rounding). `MLPDigits.forward` records the rows and, in training, the first weight's gradient
so far of every forward pass (`SEEN`), to show what a step did between its microbatches."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from service.workloads.base import no_weight_decay_groups
from service.workloads.digits import Digits

SEEN: list[tuple[int, float | None]] = []
"""(rows, sum of the first Linear weight's .grad or None) of each training forward pass."""


class MLPDigits(Digits):
    name = "mlp_digits"
    hparam_defaults: dict[str, Any] = {"width": 16}
    regularizers: dict[str, Any] = {}
    augmentation: dict[str, Any] = {}

    def build_model(self, hparams: dict[str, Any]) -> nn.Module:
        width = int(self.model_hparams(hparams)["width"])
        return nn.Sequential(
            nn.Flatten(), nn.Linear(64, width), nn.LayerNorm(width), nn.ReLU(), nn.Linear(width, 10)
        )

    def forward(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if model.training:
            grad = _first_linear(model).weight.grad
            SEEN.append((len(batch["label"]), None if grad is None else float(grad.double().sum())))
        return model(batch["features"])


class NoDecayMLPDigits(MLPDigits):
    """Biases and the LayerNorm's scale and shift in a group without weight decay."""

    def param_groups(self, model: nn.Module, hparams: dict[str, Any]) -> list[dict[str, Any]]:
        return no_weight_decay_groups(model)


def _first_linear(model: nn.Module) -> nn.Linear:
    return next(m for m in model.modules() if isinstance(m, nn.Linear))


class AdagradMLPDigits(MLPDigits):
    """Its own optimizer (`training.optimizer: workload`): Adagrad, reading eps and weight_decay."""

    def optimizer(self, param_groups, hparams):
        eps, wd = float(hparams.get("eps", 1e-10)), float(hparams.get("weight_decay", 0.0))
        return torch.optim.Adagrad(param_groups, lr=float(hparams["learning_rate"]), eps=eps, weight_decay=wd)


class DecayBlindMLPDigits(MLPDigits):
    """An own optimizer that never reads weight_decay."""

    def optimizer(self, param_groups, hparams):
        return torch.optim.Adagrad(param_groups, lr=float(hparams["learning_rate"]))
