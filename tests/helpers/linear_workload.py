"""A test workload without BatchNorm (loaded as `tests.helpers.linear_workload:LinearDigits`): a linear
model on the digits pixels. With a learning rate of 0 its weights, and so every evaluation's
metrics, never change: every evaluation ties."""

from __future__ import annotations

from typing import Any

from torch import nn

from service.workloads.digits import Digits


class LinearDigits(Digits):
    name = "linear_digits"
    hparam_defaults: dict[str, Any] = {}

    def build_model(self, hparams: dict[str, Any]) -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(64, self.num_classes))


class SpareHead(nn.Module):
    """The linear model and a second head that no forward pass uses: its parameters never get a
    gradient."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.used = nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))
        self.spare = nn.Linear(64, num_classes)

    def forward(self, x):
        return self.used(x)


class SpareHeadDigits(Digits):
    """Loaded as `tests.helpers.linear_workload:SpareHeadDigits`."""

    name = "spare_head_digits"
    hparam_defaults: dict[str, Any] = {}

    def build_model(self, hparams: dict[str, Any]) -> nn.Module:
        return SpareHead(self.num_classes)
