"""`make real-hosts`: a head and 3 worker hosts, each in its own network namespace with its own
address (tests/helpers/netns_cluster.py); the demo study's digits workload, 2 trials of 3 hosts x
1 worker, submitted with `ray job submit` from this (the root) namespace; the job's end, where
the study is, and which address each rank trained on; then everything is torn down. Needs root
and iproute2. It writes under the working directory's `.demo/` (the digits data, if missing, as
`make demo` does; the hosts' Ray logs and the study under `.demo/real-hosts`), made as needed, so
it runs from a fresh clone; the demo study file is read from the repository."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

import yaml

from tests.helpers import netns_cluster
from tests.helpers.ray_head import BIN, job_logs, wait_for_job

REPO = pathlib.Path(__file__).resolve().parents[2]
ROOT = pathlib.Path(".demo/real-hosts").absolute()
DATA = pathlib.Path(".demo/data").absolute()
DEMO_STUDY = REPO / "studies" / "digits-demo.yaml"


def study() -> dict:
    """The demo study on 3 hosts x 1 worker: 2 trials, batches divisible by 3 ranks."""
    raw = yaml.safe_load(DEMO_STUDY.read_text())
    raw["name"] = "real-hosts-demo"
    raw["data"] = {split: str(DATA / split) for split in ("train", "validation", "test")}
    raw["storage"] = str(ROOT / "studies")
    raw["scaling"] = {"num_hosts": 3, "workers_per_host": 1}
    raw["training"].update(batch_size=63, eval_batch_size=252)
    raw["rounds"] = [{"name": "explore", "num_trials": 2}]
    return raw


def where_ranks_ran(cluster, study_dir: pathlib.Path) -> list[str]:
    ip_of = {n["node_id"]: n["node_ip"] for n in cluster.nodes()}
    host_of = {h.address: name for name, h in cluster.hosts.items()}
    lines = []
    for topology in sorted(study_dir.glob("trials/*/topology.json")):
        ranks = sorted(json.loads(topology.read_text())["ranks"], key=lambda r: r["world_rank"])
        where = ", ".join(
            f"rank {r['world_rank']} on {host_of[ip_of[r['node_id']]]} ({ip_of[r['node_id']]})" for r in ranks
        )
        lines.append(f"  {topology.parent.name}: {where}")
    return lines


def print_unfinished(cluster, job_id: str) -> None:
    """An interrupted job (Ctrl-C, or a test's timeout): its log so far and what still runs."""
    print(f"interrupted while job {job_id} runs; its log so far:", flush=True)
    print(job_logs(cluster.dashboard, job_id, cluster.env)[-6000:])
    print(f"what runs on the cluster:\n{cluster.what_runs()}", flush=True)


def main() -> int:
    reason = netns_cluster.skip_reason()
    if reason:
        print(f"make real-hosts: {reason}", file=sys.stderr)
        return 2
    if not DATA.exists():
        subprocess.run([f"{BIN}/playbook", "data", "digits", str(DATA)], check=True)
    work, raw = ROOT / "work", study()
    with netns_cluster.netns_cluster(ROOT, ["h1", "h2", "h3"], cpus=2) as cluster:
        for name, host in cluster.hosts.items():
            print(f"host {name}: namespace {host.namespace}, address {host.address}", flush=True)
        print(f"ray job submit --address {cluster.dashboard} --working-dir {work} -- playbook run study.yaml")
        job_id = cluster.submit_study(raw, work)
        try:
            state, logs = wait_for_job(cluster.dashboard, job_id, cluster.env, timeout_s=1800)
        except KeyboardInterrupt:
            print_unfinished(cluster, job_id)
            raise
        print(logs[-3000:])
        study_dir = pathlib.Path(raw["storage"]) / raw["name"]
        print(f"job {job_id}: {state}; the study is at {study_dir}")
        print("\n".join(where_ranks_ran(cluster, study_dir)))
    print(f"torn down; read it again with: playbook status {raw['name']} --storage {raw['storage']}")
    return 0 if state == "SUCCEEDED" else 1


if __name__ == "__main__":
    # No options; `--help` says what it does before anything starts (hosts, data, a job).
    argparse.ArgumentParser(prog="python -m tests.helpers.real_hosts_demo", description=__doc__).parse_args()
    os.environ.pop("RAY_ADDRESS", None)
    sys.exit(main())
