"""A test workload whose training forward pass holds memory in proportion to its batch, like
activations do: `ballast_mib` MiB per row, filled (so the pages are really taken), on the
batch's device. It reaches a memory limit at a known batch size, for the batch-size probe's
out-of-memory tests (loaded as `tests.helpers.ballast_workload:BallastDigits`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from service.workloads.digits import Digits

FLOATS_PER_MIB = (1 << 20) // 4


class Ballasted(nn.Module):
    def __init__(self, inner: nn.Module, mib: int):
        super().__init__()
        self.inner, self.mib = inner, mib

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        if self.training:
            ballast = torch.ones(len(x), self.mib * FLOATS_PER_MIB, device=x.device)
            out = out + ballast.sum() * 0  # the ballast is allocated, filled and read
        return out


class BallastDigits(Digits):
    name = "ballast_digits"
    hparam_defaults: dict[str, Any] = {**Digits.hparam_defaults, "ballast_mib": 4}

    def build_model(self, hparams: dict[str, Any]) -> nn.Module:
        mib = int(self.model_hparams(hparams)["ballast_mib"])
        return Ballasted(super().build_model(hparams), mib)
