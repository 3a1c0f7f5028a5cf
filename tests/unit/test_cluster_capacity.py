"""The resource check before a study starts: judged by the nodes alive on a fixed cluster, and by
what the autoscaler can grow to on an autoscaling one (KubeRay's GPU group starts at 0 nodes).
The autoscaler's view is Ray's own ClusterConfig protobuf, serialized and parsed as the GCS
hands it over."""

from __future__ import annotations

import pytest
from ray.core.generated import autoscaler_pb2

from service.core.errors import SpecError
from service.study.checks import autoscaler_nodes, check_resources
from tests.helpers.studies import make_study


def kuberay_config() -> autoscaler_pb2.ClusterConfig:
    """deploy/kuberay/raycluster.yaml's shape: a head that takes no work, CPU workers 1..16 of
    4 CPUs, GPU workers 0..8 of 8 CPUs + 1 GPU."""
    config = autoscaler_pb2.ClusterConfig()
    for name, resources, lo, hi in [
        ("headgroup", {"CPU": 0}, 1, 1),
        ("cpu", {"CPU": 4}, 1, 16),
        ("gpu", {"CPU": 8, "GPU": 1}, 0, 8),
    ]:
        group = config.node_group_configs.add(name=name, min_count=lo, max_count=hi)
        group.resources.update(resources)
    return autoscaler_pb2.ClusterConfig.FromString(config.SerializeToString())


ALIVE_NOW = [  # what ray.nodes() shows before the autoscaler has started anything
    {"Alive": True, "Resources": {"CPU": 0}},
    {"Alive": True, "Resources": {"CPU": 4}},
]


def study(digits_dir, tmp_path, **scaling):
    batch_size = 24 * 36  # divisible by every world size below
    return make_study(
        digits_dir,
        tmp_path,
        scaling=scaling,
        training={"batch_size": batch_size, "eval_batch_size": batch_size},
    )


def test_a_gpu_study_on_an_autoscaling_cluster_is_judged_by_what_it_can_grow_to(digits_dir, tmp_path):
    s = study(digits_dir, tmp_path, num_hosts=4, workers_per_host=1, use_gpu=True, cpus_per_worker=2)
    with pytest.raises(SpecError, match="scaling.use_gpu"):
        check_resources(s, ALIVE_NOW)  # no GPU node is up yet
    check_resources(s, autoscaler_nodes(kuberay_config(), s))  # the GPU group can start 4


def test_what_no_autoscaler_can_give_is_still_refused_by_field(digits_dir, tmp_path):
    config = kuberay_config()
    too_many_gpu_hosts = study(digits_dir, tmp_path, num_hosts=9, use_gpu=True)
    with pytest.raises(
        SpecError, match="^scaling.workers_per_host: 9 GPU workers, but the Ray cluster has 8 GPUs"
    ):
        check_resources(too_many_gpu_hosts, autoscaler_nodes(config, too_many_gpu_hosts))
    too_big_worker = study(digits_dir, tmp_path, cpus_per_worker=16)
    with pytest.raises(SpecError, match="^scaling.cpus_per_worker: 16 CPUs per worker, but the largest node"):
        check_resources(too_big_worker, autoscaler_nodes(config, too_big_worker))


def test_unbounded_groups_and_no_autoscaler(digits_dir, tmp_path):
    s = study(digits_dir, tmp_path, num_hosts=3, workers_per_host=2, cpus_per_worker=1)
    assert autoscaler_nodes(None, s) == []  # a fixed cluster: the caller uses ray.nodes()
    config = autoscaler_pb2.ClusterConfig()
    group = config.node_group_configs.add(name="any", min_count=0, max_count=-1)
    group.resources.update({"CPU": 2})
    nodes = autoscaler_nodes(config, s)
    assert len(nodes) == s.scaling.world_size + 1  # bounded, yet enough for any placement
    check_resources(s, nodes)


# A trial holds its workers' CPUs and, with Ray Data input workers, theirs; its own Tune process
# holds none. Worked by hand for 2 hosts x 2 workers x 1 CPU, each worker with 2 input actors
# of 0.5 CPU: 4 x (1 + 2 x 0.5) = 8 CPUs per trial.
RAY_DATA_INPUT = {"workers": "ray_data", "num_input_workers": 2, "cpus_per_input_worker": 0.5}


def two_by_two(digits_dir, tmp_path):
    """A 2-host x 2-worker study of 1 CPU a worker, without and with Ray Data input workers."""
    layout = {"num_hosts": 2, "workers_per_host": 2, "cpus_per_worker": 1}
    with_input = make_study(
        digits_dir,
        tmp_path,
        scaling=layout,
        training={"batch_size": 32, "eval_batch_size": 64},
        input=RAY_DATA_INPUT,
    )
    return study(digits_dir, tmp_path, **layout), with_input


def test_the_check_counts_a_trials_ray_data_input_workers(digits_dir, tmp_path):
    local, with_input = two_by_two(digits_dir, tmp_path)
    four_cpus = [{"Alive": True, "Resources": {"CPU": 2}}] * 2  # the workers alone fit exactly
    check_resources(local, four_cpus)
    with pytest.raises(SpecError, match=r"^input.num_input_workers: .* = 8 CPUs, but the Ray cluster has 4"):
        check_resources(with_input, four_cpus)
    check_resources(with_input, [{"Alive": True, "Resources": {"CPU": 4}}] * 2)


def test_trials_at_once_count_everything_a_trial_holds(digits_dir, tmp_path):
    from service.orchestration.coordinator import trials_that_fit

    local, with_input = two_by_two(digits_dir, tmp_path)
    assert trials_that_fit(local, {"CPU": 4.0}) == 1  # exactly one: its driver holds no CPU
    assert trials_that_fit(local, {"CPU": 17.0}) == 4
    assert trials_that_fit(with_input, {"CPU": 17.0}) == 2  # 8 CPUs a trial
    assert trials_that_fit(with_input, {"CPU": 4.0}) == 1  # never below 1 (the check refuses it)
    gpu = study(digits_dir, tmp_path, num_hosts=2, workers_per_host=2, use_gpu=True, cpus_per_worker=1)
    assert trials_that_fit(gpu, {"CPU": 64.0, "GPU": 8.0}) == 2  # the GPUs bound it
    tenths = study(digits_dir, tmp_path, num_hosts=1, workers_per_host=3, cpus_per_worker=0.1)
    assert trials_that_fit(tenths, {"CPU": 0.9}) == 3  # 0.3 CPU each, exactly 3 (not 2.999...)
