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


def placement(node_ids: list[str]) -> list[tuple[int, int]]:
    """(host rank, local rank) of each world rank, from the Ray node id of each world rank (a
    list indexed by world rank). Hosts are numbered in the order of their lowest world rank
    (world rank 0, the writer, is on host 0) and workers within a host in world-rank order.
    Ray Train gives each node's workers consecutive world ranks, so world rank r is host
    r // workers_per_host, local rank r % workers_per_host on every placement: which data a
    world rank reads, and so the order in which gradients and metrics are summed, follows from
    the layout (hosts x workers), never from node ids or which node Ray picked first. (Ray's
    node_rank groups by IP, which is one IP for every node of a simulated cluster.)"""
    hosts: dict[str, int] = {}
    workers: dict[str, int] = {}
    out = []
    for node in node_ids:
        host = hosts.setdefault(node, len(hosts))
        out.append((host, workers.get(node, 0)))
        workers[node] = workers.get(node, 0) + 1
    return out


def world_order(rank0_node: str, worker_nodes: list[str]) -> list[int]:
    """World ranks 1.. of a group whose rank 0 is on `rank0_node`: the other workers (indices
    into `worker_nodes`, their nodes) in world-rank order. Those on rank 0's node first, then
    each other node's (by node id), so that every node's workers hold consecutive world ranks,
    as Ray Train gives them (`placement`)."""
    nodes = [rank0_node, *sorted(set(worker_nodes) - {rank0_node})]
    return sorted(range(len(worker_nodes)), key=lambda i: (nodes.index(worker_nodes[i]), i))


def rank_topology(node_ids: list[str], world_rank: int) -> Topology:
    """World rank `world_rank`'s place, from the Ray node id of every world rank (`placement`)."""
    host_rank, local_rank = placement(node_ids)[world_rank]
    node_id = node_ids[world_rank]
    return Topology(
        world_rank=world_rank,
        world_size=len(node_ids),
        host_rank=host_rank,
        num_hosts=len(set(node_ids)),
        local_rank=local_rank,
        workers_per_host=node_ids.count(node_id),
        node_id=node_id,
    )


def init_seed(trial_seed: int) -> int:
    return int(np.random.SeedSequence([trial_seed, 0]).generate_state(1)[0])


def data_seed(trial_seed: int, host_rank: int, local_rank: int) -> int:
    return int(np.random.SeedSequence([trial_seed, 1, host_rank, local_rank]).generate_state(1)[0])
