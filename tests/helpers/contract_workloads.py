"""Workloads that break or stretch the Workload contract (loaded as `tests.helpers.contract_workloads:Class`),
on the tabular example's columns (studies/tabular)."""

from __future__ import annotations

import os
import sys

import torch.nn.functional as F
from torch import nn

STUDY_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "studies", "tabular")
sys.path.insert(0, os.path.normpath(STUDY_DIR))  # the example's own module, as playbook imports it

from tabular_workload import NUM_FEATURES, TabularMLP  # noqa: E402
from write_data import write as write_tabular_data  # noqa: E402, F401


class WrongWidth(TabularMLP):
    """Says 4 classes; its model gives 3 logits."""

    name = "wrong_width"
    num_classes = 4

    def build_model(self, hparams):
        model = super().build_model(hparams)
        model[-1] = nn.Linear(model[-1].in_features, 3)
        return model


class Regression(TabularMLP):
    """A regression on the same columns: one output per example, no classes."""

    name = "regression"
    num_classes = None
    metric_names = ("loss",)

    def build_model(self, hparams):
        return nn.Sequential(nn.Linear(NUM_FEATURES, 8), nn.ReLU(), nn.Linear(8, 1))

    def to_batch(self, table):
        batch = super().to_batch(table)
        return {**batch, "label": batch["label"].float()}

    def loss(self, outputs, batch):
        return F.mse_loss(outputs[:, 0], batch["label"], reduction="none")

    def metrics(self, outputs, batch):
        return {"loss": self.loss(outputs, batch)}


class MeanLoss(TabularMLP):
    """Its loss is one number for the batch, not one per example."""

    name = "mean_loss"

    def loss(self, outputs, batch):
        return super().loss(outputs, batch).mean()
