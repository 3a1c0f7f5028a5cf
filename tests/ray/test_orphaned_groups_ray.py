"""A placement group whose creator actor died holds its CPUs while the job lives (Ray keeps it
until its creator *and* its job are dead). A Ray Train controller SIGKILLed with its trial's
process while it starts its worker group leaves such a group (Ray Train's own cleaner learns of a
group only once the workers are up), and the restarted trial then waited for those CPUs forever:
found by `make chaos`. The coordinator removes such groups while a round runs, and only those:
a group no actor made (a driver's: Ray counts its creator as dead from the start) stays."""

from __future__ import annotations

import time

import pytest
import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from tests.helpers.studies import free_cpus_after_study, make_study, run_within_timeout

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]


@ray.remote(num_cpus=0)
class GroupMaker:
    """Stands in for a Ray Train controller: it makes a group and dies with it held."""

    def make(self):
        group = placement_group([{"CPU": 1}])
        ray.get(group.ready())
        return group


def test_a_dead_actors_placement_group_is_removed_while_a_round_runs(ray_cluster, digits_dir, tmp_path):
    kept = placement_group([{"CPU": 0.5}])  # this driver's: alive as long as the driver
    ray.get(kept.ready())
    maker = GroupMaker.remote()
    group = ray.get(maker.make.remote())
    ray.kill(maker, no_restart=True)
    time.sleep(2)
    assert placement_group_table(group)["state"] == "CREATED"  # kept: the job lives
    assert ray.available_resources().get("CPU", 0) == ray.cluster_resources()["CPU"] - 1.5

    study = make_study(digits_dir, tmp_path, name="orphans", rounds=[{"name": "explore", "num_trials": 1}])
    (row,) = run_within_timeout(study)
    assert row["status"] == "FINISHED"
    assert placement_group_table(group)["state"] == "REMOVED"
    assert placement_group_table(kept)["state"] == "CREATED"
    remove_placement_group(kept)
    assert free_cpus_after_study() == ray.cluster_resources()["CPU"]
