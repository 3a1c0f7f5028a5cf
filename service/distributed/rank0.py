"""The one place that decides which side effects happen on rank 0 only.

Metrics logs, checkpoints, predictions and tracking rows are written by world rank 0; every
other rank skips them. Code elsewhere calls `rank0.run(...)` instead of testing the rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from service.distributed.topology import Topology

T = TypeVar("T")


class Rank0:
    def __init__(self, topology: Topology):
        self.topology = topology

    def run(self, fn: Callable[..., T], *args, **kwargs) -> T | None:
        """Call `fn` on world rank 0; return None elsewhere."""
        if self.topology.is_rank0:
            return fn(*args, **kwargs)
        return None
