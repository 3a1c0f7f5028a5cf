"""Reading deploy/kuberay/: its objects by kind, and the pod templates of a Ray cluster spec."""

from __future__ import annotations

from pathlib import Path

import yaml

MANIFESTS = Path(__file__).resolve().parents[2] / "deploy" / "kuberay"


def manifest_docs() -> list[tuple[str, dict]]:
    """(file name, object) for every YAML document under deploy/kuberay/."""
    docs = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def find(kind: str) -> dict:
    """The one object of `kind` in deploy/kuberay/."""
    (obj,) = [d for _, d in manifest_docs() if d["kind"] == kind]
    return obj


def pod_templates(cluster_spec: dict) -> list[tuple[str, dict]]:
    """(group name, pod spec) of the head ("head") and of every worker group."""
    groups = [("head", cluster_spec["headGroupSpec"])]
    groups += [(g["groupName"], g) for g in cluster_spec["workerGroupSpecs"]]
    return [(name, g["template"]["spec"]) for name, g in groups]


def configmap_mounts(pod: dict, configmap_name: str) -> list[str]:
    """Mount paths of the ConfigMap `configmap_name` in the pod's containers."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    return [
        m["mountPath"]
        for c in pod["containers"]
        for m in c.get("volumeMounts", [])
        if volumes[m["name"]].get("configMap", {}).get("name") == configmap_name
    ]


def kuberay_pod_labels(cluster_name: str, group: str) -> dict[str, str]:
    """The labels KubeRay (v1.x, `ray-operator/controllers/ray/utils/constant.go`) puts on a Ray
    pod of the cluster `cluster_name` in `group` ("head" or a worker group's name)."""
    node_type = "head" if group == "head" else "worker"
    return {
        "ray.io/cluster": cluster_name,
        "ray.io/group": "headgroup" if group == "head" else group,
        "ray.io/node-type": node_type,
        "ray.io/is-ray-node": "yes",
        "ray.io/identifier": f"{cluster_name}-{node_type}",
        "app.kubernetes.io/name": "kuberay",
        "app.kubernetes.io/created-by": "kuberay-operator",
    }


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector (matchLabels, matchExpressions) selects `labels`."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {
            "In": labels.get(key) in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True
