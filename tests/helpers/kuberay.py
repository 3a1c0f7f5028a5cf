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
