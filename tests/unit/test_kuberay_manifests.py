"""deploy/kuberay/*.yaml: every object validates against the KubeRay CRD schemas (RayJob,
RayCluster v1) or the Kubernetes schemas (ConfigMap, ServiceAccount), strictly (unknown fields
are errors, as with kubectl's default --validate=strict); broken manifests are rejected; and
the manifests say what deploy/README.md promises (token auth, ClusterIP dashboard, CPU and GPU
groups, resources, workload identity, the study file from the ConfigMap). The PodMonitor
(Prometheus Operator's kind, no schema here) selects every Ray pod KubeRay makes for them, and
the heads carry the environment the Ray dashboard reads to embed Grafana."""

from __future__ import annotations

import copy
import functools
import shlex
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from service.study import spec
from tests.helpers.kuberay import (
    configmap_mounts,
    find,
    kuberay_pod_labels,
    manifest_docs,
    pod_templates,
    selects,
)

ROOT = Path(__file__).resolve().parents[2]
# shared/ sits beside the repository (the worktree's or CI's clone): <repo>/../shared.
CRD_DIR = ROOT.parent / "shared" / "kuberay-crds"
K8S_VERSION = "1.33"  # the oldest Kubernetes minor the manifests are checked against
CORE_KINDS = {"ConfigMap", "ServiceAccount"}
MONITOR_KINDS = {"PodMonitor"}  # checked by test_podmonitor_selects_every_ray_pod
FAST_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are 2 MB of YAML


def strict(schema):
    """The schema with `additionalProperties: false` on every object that lists its properties
    (and does not preserve unknown fields): the API server's strict field validation."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {k: strict(v) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = strict(out[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = [strict(s) for s in out[key]]
    return out


@functools.cache
def crd_validators() -> dict[tuple[str, str], jsonschema.protocols.Validator]:
    """{(apiVersion, kind): validator} from the KubeRay CRDs' openAPIV3Schema."""
    assert CRD_DIR.is_dir(), f"{CRD_DIR}: the KubeRay CRDs are missing (shared/ beside the repo)"
    validators = {}
    for path in sorted(CRD_DIR.glob("*.yaml")):
        for crd in yaml.load_all(path.read_text(), Loader=FAST_LOADER):
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                schema = strict(version["schema"]["openAPIV3Schema"])
                validators[(f"{group}/{version['name']}", kind)] = jsonschema.Draft7Validator(schema)
    return validators


def validate(obj: dict) -> None:
    """Raise jsonschema.ValidationError if `obj` breaks its schema."""
    if obj.get("kind") in CORE_KINDS:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        return
    key = (obj.get("apiVersion"), obj.get("kind"))
    assert key in crd_validators(), f"no schema for {key}"
    crd_validators()[key].validate(obj)


def test_the_manifests_are_there():
    kinds = sorted(d["kind"] for _, d in manifest_docs())
    assert kinds == ["ConfigMap", "PodMonitor", "RayCluster", "RayJob", "ServiceAccount"]
    assert {("ray.io/v1", "RayJob"), ("ray.io/v1", "RayCluster")} <= set(crd_validators())


@pytest.mark.parametrize(
    "name,obj",
    [(n, d) for n, d in manifest_docs() if d["kind"] not in MONITOR_KINDS],
    ids=lambda v: v if isinstance(v, str) else v["kind"],
)
def test_manifest_validates(name, obj):
    validate(obj)


def _set(obj: dict, path: str, value) -> dict:
    """A copy of obj with the `/`-separated `path` (list indexes as numbers) set, or deleted if value is
    DELETE."""
    obj = copy.deepcopy(obj)
    *parents, last = [int(p) if p.isdigit() else p for p in path.split("/")]
    node = obj
    for p in parents:
        node = node[p]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return obj


DELETE = object()
BROKEN = [
    # (kind, path, new value, a word the error names)
    ("RayJob", "spec/backoffLimit", "two", "integer"),  # wrong type
    ("RayJob", "spec/shutdownAfterJobFinish", True, "shutdownAfterJobFinish"),  # misspelt field
    ("RayJob", "spec/rayClusterSpec/authOptions/mode", "tokens", "tokens"),  # not in the enum
    ("RayCluster", "spec/headGroupSpec", DELETE, "headGroupSpec"),  # required
    ("RayCluster", "spec/workerGroupSpecs/1/groupName", DELETE, "groupName"),  # required
    ("RayCluster", "spec/workerGroupSpecs/0/template/spec/containers/0/resources/limit", {}, "limit"),
    ("RayCluster", "spec/workerGroupSpecs/0/replicas", "1", "integer"),
    ("ConfigMap", "data/study.yaml", 7, "string"),
    ("ConfigMap", "metadata/nmae", "x", "nmae"),
    ("ServiceAccount", "metadata/annotations", ["iam.gke.io/gcp-service-account"], "object"),
]


@pytest.mark.parametrize("kind,path,value,word", BROKEN, ids=[f"{b[0]}:{b[1]}" for b in BROKEN])
def test_broken_manifest_is_rejected(kind, path, value, word):
    obj = find(kind)
    validate(obj)  # the intact object passes, so the change is what fails
    with pytest.raises(jsonschema.ValidationError) as err:
        validate(_set(obj, path, value))
    assert word in err.value.message, err.value.message


@pytest.mark.parametrize("kind", ["RayJob", "RayCluster"])
def test_cluster_is_secured_resourced_and_has_cpu_and_gpu_groups(kind):
    obj = find(kind)
    cluster = obj["spec"]["rayClusterSpec"] if kind == "RayJob" else obj["spec"]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    ray_pin = next(d for d in project["dependencies"] if d.startswith("ray[")).split("==")[1]
    assert cluster["rayVersion"] == ray_pin
    assert cluster["authOptions"]["mode"] == "token"
    head = cluster["headGroupSpec"]
    assert head.get("serviceType") == "ClusterIP" and not head.get("enableIngress")

    account = find("ServiceAccount")
    assert account["metadata"]["annotations"]["iam.gke.io/gcp-service-account"].endswith(
        ".iam.gserviceaccount.com"
    )
    gpu_groups = []
    for name, pod in pod_templates(cluster):
        assert pod["serviceAccountName"] == account["metadata"]["name"], name
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert not any("secret" in v for v in pod.get("volumes", [])), f"{name}: no key files"
        for c in pod["containers"]:
            for need in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][need]), f"{name}: {need}"
            env = {e["name"] for e in c.get("env", [])}
            assert not env & {"GOOGLE_APPLICATION_CREDENTIALS", "RAY_AUTH_TOKEN"}, name
            gpus = c["resources"]["limits"].get("nvidia.com/gpu")
            tag = c["image"].rsplit(":", 1)[1]
            assert tag == (f"{project['version']}-gpu" if gpus else project["version"]), name
            if gpus:
                gpu_groups.append(name)
    workers = [g["groupName"] for g in cluster["workerGroupSpecs"]]
    assert gpu_groups and set(workers) - set(gpu_groups), "a CPU and a GPU worker group"


def test_rayjob_runs_one_study_from_the_configmap():
    job, config = find("RayJob"), find("ConfigMap")
    assert job["spec"]["shutdownAfterJobFinishes"] is True
    assert job["spec"]["ttlSecondsAfterFinished"] > 0
    assert job["spec"]["backoffLimit"] >= 1
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["playbook", "run"] and len(argv) == 3
    study_path = Path(argv[2])
    # Every pod mounts the ConfigMap where the entrypoint reads the study (the driver runs on
    # the head, but entrypoint resources could place it on a worker).
    for name, pod in pod_templates(job["spec"]["rayClusterSpec"]):
        mounts = configmap_mounts(pod, config["metadata"]["name"])
        assert [Path(m) for m in mounts] == [study_path.parent], name
    study = spec.load_text(config["data"][study_path.name])
    assert study.storage.startswith("gs://") and study.data.train.startswith("gs://")


def ray_clusters() -> list[tuple[str, dict]]:
    """(the name KubeRay gives the cluster, its spec) of the RayCluster and of the RayJob's
    cluster (named after the job, with a random suffix)."""
    job = find("RayJob")
    return [
        (find("RayCluster")["metadata"]["name"], find("RayCluster")["spec"]),
        (f"{job['metadata']['name']}-x7k2p", job["spec"]["rayClusterSpec"]),
    ]


def test_podmonitor_selects_every_ray_pod():
    monitor = find("PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics"  # the port KubeRay names on every Ray container
    for cluster_name, cluster in ray_clusters():
        for group, pod in pod_templates(cluster):
            labels = kuberay_pod_labels(cluster_name, group)
            assert selects(monitor["spec"]["selector"], labels), (cluster_name, group)
            # KubeRay adds its `metrics` port only to a container that lists no ports of its own
            assert all("ports" not in c for c in pod["containers"]), (cluster_name, group)
    # and not pods that are not Ray's
    assert not selects(monitor["spec"]["selector"], {"app": "prometheus"})
    assert not selects(
        monitor["spec"]["selector"], {**kuberay_pod_labels("x", "head"), "ray.io/node-type": "redis"}
    )


@pytest.mark.parametrize("kind", ["RayJob", "RayCluster"])
def test_head_embeds_grafana(kind):
    from ray.dashboard.modules.metrics import metrics_head

    obj = find(kind)
    cluster = obj["spec"]["rayClusterSpec"] if kind == "RayJob" else obj["spec"]
    (head,) = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in head["env"]}
    read_by_ray = {
        metrics_head.PROMETHEUS_HOST_ENV_VAR,
        metrics_head.PROMETHEUS_NAME_ENV_VAR,
        metrics_head.GRAFANA_HOST_ENV_VAR,
        metrics_head.GRAFANA_IFRAME_HOST_ENV_VAR,
    }
    assert set(env) == read_by_ray
    assert all(env[k].startswith("http://") for k in read_by_ray - {metrics_head.PROMETHEUS_NAME_ENV_VAR})
