"""A pool of reused workers on GPUs (`scaling.use_gpu`) sees its GPUs as a Ray Train worker group
does: every rank of the trial sees all of the trial's GPUs on its node and trains on its own
(service/distributed/devices.py), so that NCCL between them can use CUDA IPC and NVLink. Ray
makes a process that holds one GPU see only that one.

No GPU here: the nodes of a simulated cluster declare GPUs that Ray assigns and masks as it
would real ones. The trial's process is an actor in the first bundle of the trial's placement
group (as Tune's trial is); its pool places its actors and shares the GPUs, and every rank
reports what it sees and the device it would train on (CUDA itself is not started)."""

from __future__ import annotations

import pytest

from service.study.training import Scaling
from tests.helpers.simulated_cluster import simulated_cluster

pytestmark = pytest.mark.timeout(300)
GPUS_PER_NODE = 3  # the trial takes 2 of each node's 3: not simply the first ones


@pytest.fixture(scope="module")
def gpu_cluster():
    import ray

    with simulated_cluster([{"num_cpus": 2, "num_gpus": GPUS_PER_NODE}] * 2):
        yield ray


def shared_by_a_pool(ray, scaling: Scaling, taken: dict):
    """Place a pool for `scaling` from an actor in the first bundle of its placement group, after
    `taken` (resources of a bundle) was reserved on the first node; (node id, Ray's GPU ids) and
    (what it sees, its device) of every rank, by world rank."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from service.orchestration import worker_pool
    from service.orchestration.tune_run import placement_strategy

    @ray.remote
    class TrialProcess:
        def share(self, scaling):
            pool = worker_pool.WorkerPool(scaling)
            try:
                placements = pool._place()
                return placements, [(seen, str(device)) for seen, device in pool._share_gpus(placements)]
            finally:
                pool.kill_workers()

    other = placement_group([taken])  # another trial's GPU on a node
    ray.get(other.ready())
    bundle = {"CPU": scaling.cpus_per_worker, "GPU": 1}
    group = placement_group([bundle] * scaling.world_size, strategy=placement_strategy(scaling))
    ray.get(group.ready())
    try:
        strategy = PlacementGroupSchedulingStrategy(group, 0, placement_group_capture_child_tasks=True)
        trial = TrialProcess.options(num_cpus=1, num_gpus=1, scheduling_strategy=strategy).remote()
        return ray.get(trial.share.remote(scaling))
    finally:
        remove_placement_group(group)
        remove_placement_group(other)


def test_a_pools_ranks_see_the_trials_gpus_on_their_node_and_use_their_own(gpu_cluster):
    scaling = Scaling(num_hosts=2, workers_per_host=2, use_gpu=True)
    placements, shared = shared_by_a_pool(gpu_cluster, scaling, {"GPU": 1})
    nodes = {node for node, _ in placements}
    assert len(nodes) == 2 and all(len(gpus) == 1 for _, gpus in placements), placements
    for node in nodes:
        ranks = [r for r, (n, _) in enumerate(placements) if n == node]
        own = [placements[r][1][0] for r in ranks]
        assert len(ranks) == 2 and len(set(own)) == 2, placements
        for r in ranks:  # the same GPUs, in id order: the node's ranks' own and no other
            assert shared[r][0].split(",") == sorted(own, key=int), (r, shared)
            assert shared[r][1] == f"cuda:{sorted(own, key=int).index(placements[r][1][0])}", (r, shared)
    assert sorted(shared[r][1] for r in range(4)) == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]
