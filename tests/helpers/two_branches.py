"""A model whose steps leave some parameters without a gradient: a trunk and two heads, each
forward pass using one head."""

from __future__ import annotations

import torch
from torch import nn


class TwoBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk, self.a, self.b = nn.Linear(6, 4), nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, head: str) -> torch.Tensor:
        return (self.a if head == "a" else self.b)(torch.relu(self.trunk(x)))
