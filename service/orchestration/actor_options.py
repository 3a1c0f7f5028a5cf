"""What the actors a study's driver starts (its coordinator, `playbook eval`'s run, the
coordinator's Tune runs) are given: the driver's environment and a place on its node."""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from service.core import storage


def cluster_env() -> dict[str, str]:
    """Merged into the job's runtime env of what the driver starts (a study's coordinator,
    `playbook eval`'s run), inherited by every process under it: what the storage layer reads
    (a gs:// emulator, ...), and this cluster's address. Without it Ray Train's placement-group
    cleaner asks Ray's state API for "the" Ray of its machine, which fails (a traceback in the
    output) where another Ray runs on the same machine."""
    return {**storage.forwarded_env(), "RAY_ADDRESS": ray.get_runtime_context().gcs_address}


def on_this_node() -> NodeAffinitySchedulingStrategy:
    """Placement on the caller's node, which the actor then shares the fate of: the coordinator
    on the driver's (the head, for `ray job submit`), its Tune runs on the coordinator's. Left to
    Ray, they could land on any worker host, and losing that host would end the study."""
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
