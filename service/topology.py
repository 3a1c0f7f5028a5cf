"""Who is where, and the seeds that follow from it.

One *init seed* for the whole trial (every rank builds bit-identical initial weights) and one
*data seed* per (host, local worker) for shuffling, derived from the trial seed so that a rerun
with the same seed sees the same data order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Topology:
    world_rank: int = 0
    world_size: int = 1
    host_rank: int = 0
    num_hosts: int = 1
    local_rank: int = 0
    workers_per_host: int = 1
    node_id: str = ""
    """The Ray node id of this worker's host (empty outside Ray)."""

    @property
    def is_rank0(self) -> bool:
        return self.world_rank == 0


def host_ranks(node_ids: list[str]) -> list[int]:
    """Host rank of each worker from the Ray node id it runs on: the index of its node among the
    sorted distinct node ids. (Ray's node_rank groups by IP, which is one IP for every node of a
    simulated cluster.)"""
    order = {node: i for i, node in enumerate(sorted(set(node_ids)))}
    return [order[n] for n in node_ids]


def init_seed(trial_seed: int) -> int:
    return int(np.random.SeedSequence([trial_seed, 0]).generate_state(1)[0])


def data_seed(trial_seed: int, host_rank: int, local_rank: int) -> int:
    return int(np.random.SeedSequence([trial_seed, 1, host_rank, local_rank]).generate_state(1)[0])
