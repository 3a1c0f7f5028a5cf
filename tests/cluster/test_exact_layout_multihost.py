"""The documented multi-host example (studies/digits-zero-multihost.yaml: 2 hosts x 2 workers x
1 CPU) on a simulated cluster sized exactly to it: a head without CPUs and 2 nodes of 2 CPUs.
It passes the pre-flight check and runs to completion on 2 hosts x 2 workers."""

from __future__ import annotations

import json
import os

import pytest

from service.study import spec
from tests.helpers.simulated_cluster import simulated_cluster
from tests.helpers.studies import run_within_timeout

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]
EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "studies", "digits-zero-multihost.yaml")


@pytest.fixture(scope="module")
def two_hosts_of_two_cpus():
    import ray

    from service.orchestration.coordinator import NAMESPACE

    with simulated_cluster([{"num_cpus": 2}] * 2, namespace=NAMESPACE):
        yield ray


def documented_example(digits_dir, storage, **scaling) -> spec.Study:
    """The example's layout and training set-up, shortened to one short trial; `scaling`
    overrides fields of its scaling section."""
    with open(EXAMPLE) as f:
        d = spec.to_dict(spec.load_text(f.read(), source=EXAMPLE))
    d["data"] = {s: str(digits_dir / s) for s in ("train", "validation")}
    d["storage"] = str(storage)
    d["training"].update(
        max_train_steps=20,
        eval_every_steps=10,
        schedule={"kind": "linear", "warmup_steps": 2, "decay_steps": 10},
    )
    d["search"]["width"] = {"role": "fixed", "value": 8}
    d["rounds"] = [{"name": "explore", "num_trials": 1}]
    d["scaling"].update(scaling)
    return spec.load_dict(d)


def test_the_documented_multihost_example_runs_on_exactly_its_cpus(
    two_hosts_of_two_cpus, digits_dir, tmp_path
):
    from service.orchestration.coordinator import trials_that_fit
    from service.study.checks import check_resources

    ray = two_hosts_of_two_cpus  # as a Ray Train run per trial: its controller needs no CPU
    study = documented_example(digits_dir, tmp_path, reuse_workers=False)
    assert (study.scaling.num_hosts, study.scaling.workers_per_host, study.scaling.cpus_per_worker) == (
        2,
        2,
        1,
    )
    check_resources(study, ray.nodes())
    assert trials_that_fit(study, ray.cluster_resources()) == 1
    (row,) = run_within_timeout(study)
    assert row["status"] == "FINISHED" and row["step"] == 20
    assert row["best_checkpoint"] is not None and os.path.isdir(row["best_checkpoint"])
    with open(os.path.join(study.study_uri, "trials", row["trial_name"], "topology.json")) as f:
        ranks = json.load(f)["ranks"]
    assert sorted((r["host_rank"], r["local_rank"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_the_example_on_a_reused_pool_runs_on_exactly_its_cpus(two_hosts_of_two_cpus, digits_dir, tmp_path):
    """The same layout as the example runs it (on reused workers, the default): the trial's own
    process is world rank 0, the pool's actors the others, all four in the trial's placement
    group on exactly the cluster's CPUs; the second trial runs on the first one's processes;
    each node holds one host's ranks."""
    d = spec.to_dict(documented_example(digits_dir, tmp_path))
    assert d["scaling"]["reuse_workers"] is True
    d["rounds"] = [{"name": "explore", "num_trials": 2}]
    study = spec.load_dict(d)
    rows = run_within_timeout(study)
    assert [r["status"] for r in rows] == ["FINISHED", "FINISHED"]
    layouts = []
    for row in rows:
        with open(os.path.join(study.study_uri, "trials", row["trial_name"], "topology.json")) as f:
            ranks = sorted(json.load(f)["ranks"], key=lambda r: r["world_rank"])
        assert [(r["host_rank"], r["local_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        nodes = [r["node_id"] for r in ranks]
        assert nodes[0] == nodes[1] != nodes[2] == nodes[3]
        layouts.append([(r["pid"], r["node_id"]) for r in ranks])
    assert layouts[0] == layouts[1]  # the same processes, in the same places
