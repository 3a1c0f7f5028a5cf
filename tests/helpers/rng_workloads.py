"""Digits workloads whose training draws from the random generators (torch's; numpy's and Python's
global ones), so that a resume must restore each generator to match an uninterrupted run."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn

from service.workloads.digits import Digits, SmallConvNet


class DropoutDigits(Digits):
    """Digits with input dropout, so that training consumes the torch RNG (resume must restore it)."""

    name = "dropout_digits"

    def build_model(self, hparams):
        return nn.Sequential(
            nn.Dropout(0.2), SmallConvNet(self.num_classes, int(self.model_hparams(hparams)["width"]))
        )


class HostRngDigits(Digits):
    """Digits whose training-time augmentation draws from numpy's and Python's global
    generators (as many user workloads do), in the training thread."""

    name = "host_rng_digits"

    def forward(self, model, batch):
        x = batch["features"]
        if model.training:
            noise = np.random.normal(0.0, 0.05, size=tuple(x.shape)).astype(np.float32)
            x = x * (1.0 + 0.1 * random.random()) + torch.from_numpy(noise)
        return model(x)
