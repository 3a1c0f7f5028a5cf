"""Built-in workload: scikit-learn's bundled 8x8 handwritten digits, a small conv net with BN.

`digits` is the 10-class task. `digits_zero` ("is it a zero?") is the same images as a real
imbalanced binary task (about 1 positive in 10).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F
from torch import nn

from service.workloads.base import Workload, classification_loss, classification_metrics


class RandomShift(nn.Module):
    """Training-time augmentation: each image moved by -1, 0 or 1 pixel along each axis (zero
    fill), drawn from torch's generator. The identity in eval mode."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        n, c, h, w = x.shape
        dy, dx = torch.randint(0, 3, (2, n, 1), device=x.device)
        padded = F.pad(x, (1, 1, 1, 1))
        rows = (dy + torch.arange(h, device=x.device))[:, None, :, None].expand(n, c, h, w + 2)
        cols = (dx + torch.arange(w, device=x.device))[:, None, None, :].expand(n, c, h, w)
        return padded.gather(2, rows).gather(3, cols)


class SmallConvNet(nn.Module):
    def __init__(self, num_classes: int, width: int, dropout: float = 0.0, augment: bool = False):
        super().__init__()
        self.augment = RandomShift() if augment else nn.Identity()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1, stride=2, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.dropout(self.features(self.augment(x))))


class Digits(Workload):
    name = "digits"
    feature_columns = ("pixels",)
    column_types = {"example_id": "integer", "pixels": "list<numeric>", "label": "integer"}
    hparam_defaults = {"width": 16, "dropout": 0.0, "augment": False}
    regularizers = {"dropout": 0.0}
    augmentation = {"augment": False}
    metric_names = ("loss", "error")
    num_classes = 10

    def build_model(self, hparams: dict[str, Any]) -> nn.Module:
        hp = self.model_hparams(hparams)
        return SmallConvNet(self.num_classes, int(hp["width"]), float(hp["dropout"]), bool(hp["augment"]))

    def to_batch(self, table: pa.Table) -> dict[str, torch.Tensor]:
        # One copy straight from the chunks (a window's table has one per row group), which is
        # also the writable array torch wants; combine_chunks first would copy twice.
        chunks = [c.flatten().to_numpy(zero_copy_only=False) for c in table.column("pixels").chunks]
        pixels = np.concatenate(chunks, dtype=np.float32) if chunks else np.empty(0, np.float32)
        labels = table.column(self.label_column).to_numpy().astype(np.int64)
        return {
            "features": torch.from_numpy(pixels).view(-1, 1, 8, 8),
            "label": torch.from_numpy(self.map_labels(labels)),
        }

    def map_labels(self, labels: np.ndarray) -> np.ndarray:
        return labels

    def loss(self, outputs, batch):
        return classification_loss(outputs, batch)

    def metrics(self, outputs, batch):
        return classification_metrics(outputs, batch)


class DigitsZero(Digits):
    name = "digits_zero"
    num_classes = 2

    def map_labels(self, labels: np.ndarray) -> np.ndarray:
        return (labels == 0).astype(np.int64)
