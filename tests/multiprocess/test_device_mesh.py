"""The device mesh of a trial on a reused pool: HSDP's 2-D mesh makes a process group per
dimension, and a pool trains trial after trial in one default group, so each trial asking for
its mesh must not add groups. A new default group (a pool closed and started again) gets a mesh
of its own."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _world

from service.distributed import sharding
from tests.helpers.gloo import join_gloo, run_gloo

TRIALS = 5


def shard_sum(mesh) -> float:
    """This rank's world rank summed over its shard group."""
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value, group=mesh.get_group("shard"))
    return value.item()


def meshes_of_trials(rank: int, world_size: int, init_file: str) -> dict:
    groups, sums, same = [], [], []
    first = sharding.device_mesh("cpu", 2)
    for _ in range(TRIALS):
        mesh = sharding.device_mesh("cpu", 2)
        same.append(mesh is first)
        sums.append(shard_sum(mesh))
        groups.append(len(_world.pg_map))
    # The pool closed and a new one started: a new default group, so a new mesh over it.
    dist.barrier()
    dist.destroy_process_group()
    join_gloo(rank, world_size, init_file)
    after = sharding.device_mesh("cpu", 2)
    return {
        "groups": groups,
        "sums": sums,
        "same": same,
        "new_mesh": after is not first,
        "sum_after": shard_sum(after),
    }


def test_a_pool_trials_hsdp_mesh_is_made_once_per_default_group(tmp_path):
    results = run_gloo(meshes_of_trials, 4, tmp_path, str(tmp_path / "second-init"))
    for rank, got in enumerate(results):
        want = 0 + 1 if rank < 2 else 2 + 3  # consecutive ranks share a shard group
        assert got["sums"] == [want] * TRIALS and got["sum_after"] == want
        assert len(set(got["groups"])) == 1, got["groups"]  # no group added per trial
        assert all(got["same"]) and got["new_mesh"]
