"""Host and local ranks from where Ray put each world rank (`topology.placement`): the layout
decides them, never the node ids."""

from __future__ import annotations

from service.distributed.topology import placement


def test_world_rank_0_is_on_host_0_whatever_its_node_id():
    # Ray Train gives each node's workers consecutive world ranks, nodes in whatever order it
    # placed them: here the highest node id holds world ranks 0 and 1.
    assert placement(["ffff", "ffff", "0000", "0000"]) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert placement(["0000", "0000", "ffff", "ffff"]) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_every_placement_of_a_layout_gives_world_rank_r_the_same_place():
    """3 hosts x 2 workers: (host, local) of world rank r is (r // 2, r % 2) on every order of
    the nodes (worked out by hand, independently of the node ids)."""
    from itertools import permutations

    expected = [(r // 2, r % 2) for r in range(6)]
    for order in permutations(["a1", "b2", "c3"]):
        node_of_rank = [node for node in order for _ in range(2)]
        assert placement(node_of_rank) == expected


def test_one_host():
    assert placement(["n"]) == [(0, 0)]
    assert placement(["n", "n", "n"]) == [(0, 0), (0, 1), (0, 2)]


def test_a_pool_in_any_bundle_order_gives_world_rank_r_the_layout_place():
    """A reused pool's ranks (`worker_pool`): rank 0 is the trial's process, the other workers
    come in bundle order from wherever Ray put them. 3 hosts x 2 workers, rank 0 on node b2:
    every bundle order ranks each node's workers consecutively, so world rank r gets
    (r // 2, r % 2) (worked out by hand) and the nodes hold ranks 0-1 (b2), 2-3 (a1), 4-5 (c3)."""
    from itertools import permutations

    from service.distributed.topology import world_order

    for bundles in set(permutations(["b2", "a1", "a1", "c3", "c3"])):
        order = world_order("b2", list(bundles))
        assert sorted(order) == list(range(5))
        node_of_rank = ["b2", *(bundles[i] for i in order)]
        assert node_of_rank == ["b2", "b2", "a1", "a1", "c3", "c3"]
        assert placement(node_of_rank) == [(r // 2, r % 2) for r in range(6)]
