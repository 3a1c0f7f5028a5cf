"""A workload of one's own (docs/workloads.md): a tabular MLP with BatchNorm over float feature
columns, a 3-class label, and ids in a column of its own (`row_id`).

Imported as `tabular_workload:TabularMLP` from the study file's folder (or the working
directory) by `playbook` and by every Ray worker of the study.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F
from torch import nn

from service.workloads.base import Workload

NUM_FEATURES = 6


class TabularMLP(Workload):
    name = "tabular_mlp"
    id_column = "row_id"  # the loader reads it: every prediction row carries it as example_id
    label_column = "y"
    feature_columns = tuple(f"f{i}" for i in range(NUM_FEATURES))
    metric_names = ("loss", "error")
    num_classes = 3  # outputs are [batch, 3] logits: per-class precision / recall in evaluations
    hparam_defaults = {"hidden": 32}

    def build_model(self, hparams: dict[str, Any]) -> nn.Module:
        hidden = int(self.model_hparams(hparams)["hidden"])
        return nn.Sequential(
            nn.Linear(NUM_FEATURES, hidden, bias=False),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, self.num_classes),
        )

    def to_batch(self, table: pa.Table) -> dict[str, torch.Tensor]:
        # One [rows, features] float32 array from the columns, no per-row Python loop.
        features = np.stack(
            [table.column(c).to_numpy().astype(np.float32) for c in self.feature_columns], axis=1
        )
        labels = table.column(self.label_column).to_numpy().astype(np.int64)
        return {"features": torch.from_numpy(features), "label": torch.from_numpy(labels)}

    def loss(self, outputs, batch):
        return F.cross_entropy(outputs, batch["label"], reduction="none")

    def metrics(self, outputs, batch):
        return {
            "loss": F.cross_entropy(outputs, batch["label"], reduction="none"),
            "error": (outputs.argmax(dim=1) != batch["label"]).float(),
        }
