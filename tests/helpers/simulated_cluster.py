"""A simulated multi-node Ray cluster in this process (`ray.cluster_utils.Cluster`): a head
without CPUs (the driver, a study's coordinator and Ray Train's controller need none) and the
given hosts, this process connected to it; all of it ended afterwards."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def simulated_cluster(hosts: list[dict], head: dict | None = None, **init):
    """The cluster of `hosts` (each `Cluster.add_node`'s arguments: num_cpus, num_gpus, ...),
    `head` added to the head's arguments, `init` to `ray.init`'s."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, **(head or {})})
    for host in hosts:
        cluster.add_node(**host)
    ray.init(address=cluster.address, **init)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
