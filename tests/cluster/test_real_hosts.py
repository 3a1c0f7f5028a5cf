"""Real hosts: a Ray cluster whose nodes each live in a Linux network namespace with an address
of their own (tests/helpers/netns_cluster.py), studies submitted with `ray job submit` from the
root namespace. Each trial is compared with the same trial trained without Ray or a network:
`loop.train` in one gloo process per rank on this machine (tests/helpers/gloo.py), each given
the world, host and local rank the layout assigns. The hosts are checked against what the
network says: Ray's node table (the IP of each node id in topology.json) and Ray Train's own
record of its workers (their node IP, node_rank and pid), or on a pool of reused workers Ray's
actor table (each rank's process, its pid and node). First, `make real-hosts`'s entry point
run from a clean working directory, as on a fresh clone."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from service.data.files import list_files
from service.distributed import checkpoint
from service.distributed.topology import Topology
from service.planning.trial import TrialPlan
from service.study import spec
from tests.helpers import netns_cluster
from tests.helpers.gloo import run_gloo
from tests.helpers.one_worker_trials import committed_steps, resumed_from, wait_for
from tests.helpers.ray_head import wait_for_job
from tests.helpers.studies import TRIAL_LAYOUTS, same_nested, study_dict
from tests.helpers.trainer_runs import Reporter, read_log, without_timing

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]
HPARAMS = {"learning_rate": 0.05, "momentum": 0.9, "width": 4}
TRIAL = "explore-0000"
WORKERS = ["h1", "h2", "h3"]
JOB_TIMEOUT_S = 480


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = netns_cluster.skip_reason()
    if reason:
        pytest.skip(reason)
    with netns_cluster.netns_cluster(tmp_path_factory.mktemp("netns"), WORKERS, cpus=2) as c:
        yield c


# `make real-hosts` from a clean working directory. It runs before the module's cluster starts
# (tests run in file order), so the two clusters never share the machine's cores.

REPO = pathlib.Path(__file__).resolve().parents[2]
DEMO_TIMEOUT_S = 600
"""The demo took 68 s from a fresh clone on this machine (2026-12-05); past this it gets SIGINT,
so that it tears its cluster down itself, before the test's own timeout."""


def cluster_leftovers(cluster_id: str) -> list[str]:
    """What a namespace cluster of id `cluster_id` left on this machine: its namespaces, its
    veths and bridge, its Ray temp dirs and /etc/netns entries (netns_cluster's names)."""
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    link_names = [line.split(": ")[1].split("@")[0] for line in links.splitlines()]
    return (
        [
            f"netns {line.split()[0]}"
            for line in namespaces.splitlines()
            if line.startswith(f"pb{cluster_id}-")
        ]
        + [f"link {n}" for n in link_names if n == f"pbr{cluster_id}" or n.startswith(f"pv{cluster_id}-")]
        + glob.glob(f"/tmp/rn-{cluster_id}-*")
        + glob.glob(os.path.join(netns_cluster.NETNS_ETC, f"pb{cluster_id}-*"))
    )


def remove_leftovers(left: list[str]) -> None:
    """Kill and delete what `cluster_leftovers` found (of a demo that did not tear down)."""
    for item in left:
        if item.startswith("netns "):
            netns_cluster.kill_namespace(item.split()[1])
            subprocess.run(["ip", "netns", "del", item.split()[1]], capture_output=True)
    for item in left:
        if item.startswith("link "):
            subprocess.run(["ip", "link", "del", item.split()[1]], capture_output=True)
        elif item.startswith("/"):
            shutil.rmtree(item, ignore_errors=True)


def test_make_real_hosts_runs_from_a_clean_working_directory(tmp_path):
    """`make real-hosts`'s command, `python -m tests.helpers.real_hosts_demo`, run in an empty
    directory, as on a fresh clone (no .demo/): it writes the digits data, brings the cluster up
    with its hosts' logs in .demo/real-hosts, the job succeeds, each of its 2 trials ran its 3
    ranks on 3 different hosts, and it tears down everything it started. (It failed at once with
    `FileNotFoundError: .demo/real-hosts/ray-head.log` while only pytest's folders existed.)"""
    reason = netns_cluster.skip_reason()
    if reason:
        pytest.skip(reason)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    env.pop("RAY_ADDRESS", None)
    demo = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.real_hosts_demo"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    cluster_id = f"{demo.pid:x}0"  # netns_cluster's id of a process's first cluster
    try:
        out, _ = demo.communicate(timeout=DEMO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        demo.send_signal(signal.SIGINT)  # KeyboardInterrupt: its netns_cluster block tears down
        out, _ = demo.communicate(timeout=120)
        out = f"timed out after {DEMO_TIMEOUT_S} s\n{out}"
    finally:
        if demo.poll() is None:  # SIGINT unanswered, or the test itself interrupted
            demo.kill()
            demo.wait()
        left = cluster_leftovers(cluster_id)
        remove_leftovers(left)
    assert demo.returncode == 0, out[-12000:]
    assert not left, f"the demo left {left}"
    assert re.search(r"job raysubmit_\w+: SUCCEEDED", out), out[-6000:]
    assert (tmp_path / ".demo" / "real-hosts" / "ray-head.log").exists()
    ranks = re.findall(r"explore-000\d: rank 0 on (h\d) .*, rank 1 on (h\d) .*, rank 2 on (h\d) ", out)
    assert len(ranks) == 2 and all(len(set(hosts)) == 3 for hosts in ranks), out[-3000:]
    assert "torn down" in out


def one_trial_study(
    digits_dir, storage, name: str, hosts: int, per_host: int, steps: int, every: int, layout="ray-train"
):
    """A study of one trial with every hyperparameter fixed (HPARAMS), as plain data: by default
    a Ray Train run (`reuse_workers: false`), whose own records of its workers and checkpoints
    (its state API, its controller's snapshot) the checks compare with the trial's; or on a pool
    of reused workers (`layout="pool"`, the default for users), whose ranks Ray's actor table
    records."""
    batch = 30 if hosts * per_host == 3 else 32  # divisible by the workers
    return study_dict(
        digits_dir,
        storage,
        name=name,
        scaling={**TRIAL_LAYOUTS[layout], "num_hosts": hosts, "workers_per_host": per_host},
        training={
            "max_train_steps": steps,
            "eval_every_steps": every,
            "batch_size": batch,
            "eval_batch_size": 2 * batch,
        },
        search={k: {"role": "fixed", "value": v} for k, v in HPARAMS.items()},
        rounds=[{"name": "explore", "num_trials": 1}],
    )


def plan_of(raw: dict) -> TrialPlan:
    study = spec.load_dict(raw)
    return TrialPlan(study, TRIAL, "explore", dict(HPARAMS), study.training.max_train_steps)


# The reference: the same trial trained in plain gloo processes, no Ray, no network namespace.


def reference_rank(rank: int, world: int, raw: dict, per_host: int, store: str) -> list[str]:
    import torch

    from service.trainer.loop import train

    torch.set_num_threads(1)
    topo = Topology(
        world_rank=rank,
        world_size=world,
        host_rank=rank // per_host,
        num_hosts=world // per_host,
        local_rank=rank % per_host,
        workers_per_host=per_host,
    )
    reporter = Reporter(pathlib.Path(store))
    train(plan_of(raw), topo, reporter)
    return [d for _, d in reporter.reports if d]


def reference_run(raw: dict, tmp_path) -> tuple[TrialPlan, dict[int, str]]:
    """(plan, {step: checkpoint folder}) of the trial of `raw` trained by gloo processes (into
    `raw`'s storage: another than the job's, or its metrics log would be compared with itself)."""
    tmp_path.mkdir(exist_ok=True)
    scaling = raw["scaling"]
    world = scaling["num_hosts"] * scaling["workers_per_host"]
    folders = run_gloo(reference_rank, world, tmp_path, raw, scaling["workers_per_host"], str(tmp_path))[0]
    return plan_of(raw), {checkpoint.step_of(d): d for d in folders}


# Submitting a study and reading what it wrote.


def finish(cluster, job_id: str) -> str:
    state, logs = wait_for_job(cluster.dashboard, job_id, cluster.env, timeout_s=JOB_TIMEOUT_S)
    assert state == "SUCCEEDED", logs[-4000:]
    return logs


def api(cluster, path: str):
    req = urllib.request.Request(
        f"{cluster.dashboard}{path}", headers={"Authorization": f"Bearer {cluster.env['RAY_AUTH_TOKEN']}"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


def job_seconds(cluster, submission_id: str) -> float:
    """How long the job ran, by the job server's clock."""
    job = api(cluster, f"/api/jobs/{submission_id}")
    return (job["end_time"] - job["start_time"]) / 1000


def train_attempts(cluster, submission_id: str) -> list[list[dict]]:
    """Ray Train's record of each attempt of the job's run of TRIAL: its workers (world_rank,
    node_rank, node_ip, pid, ...), in attempt order."""
    job = api(cluster, f"/api/jobs/{submission_id}")["job_id"]
    runs = api(cluster, "/api/train/v2/runs/v1")["train_runs"]
    (run,) = [r for r in runs if r["name"] == TRIAL and r["job_id"] == job]
    return [sorted(a["workers"], key=lambda w: w["world_rank"]) for a in run["attempts"]]


def pool_ranks(cluster, submission_id: str) -> dict[int, str]:
    """pid -> node IP of every process a pooled trial of the job ran on, alive or ended: its
    Tune trial's process (world rank 0) and its pool's workers (Ray's actor table)."""
    job = api(cluster, f"/api/jobs/{submission_id}")["job_id"]
    actors = api(cluster, "/api/v0/actors?limit=1000&detail=true")["data"]["result"]["result"]
    ip_of = {n["node_id"]: n["node_ip"] for n in cluster.nodes()}
    return {
        a["pid"]: ip_of[a["node_id"]]
        for a in actors
        if a["job_id"] == job and a["class_name"] in ("ImplicitFunc", "PoolWorker") and a["pid"]
    }


def kept_checkpoints(plan: TrialPlan) -> dict[int, str]:
    folders = [
        os.path.join(plan.trial_uri, d) for d in os.listdir(plan.trial_uri) if d.startswith("checkpoint_")
    ]
    return {checkpoint.step_of(d): d for d in folders if checkpoint.is_complete(d)}


def assert_same_trial(plan: TrialPlan, reference: tuple[TrialPlan, dict[int, str]]) -> None:
    """The metrics log at every eval and every kept checkpoint (model, optimizer, every rank's
    generators, precision state, step; history without timings) equal the reference's."""
    ref_plan, ref_checkpoints = reference
    logs = [json.dumps([without_timing(r) for r in read_log(p)]) for p in (plan, ref_plan)]
    assert logs[0] == logs[1]
    kept = kept_checkpoints(plan)
    assert plan.max_train_steps in kept and set(kept) <= set(ref_checkpoints)
    for step, folder in kept.items():
        got, want = checkpoint.load(folder), checkpoint.load(ref_checkpoints[step])
        history = [json.dumps([without_timing(r) for r in s.history]) for s in (got, want)]
        assert history[0] == history[1], step  # as JSON: NaN (an empty class's precision) equals itself
        got.history, want.history = [], []
        assert same_nested(vars(got), vars(want)), step


def node_ips(cluster, topology: dict) -> list[str]:
    """The IP of each world rank's node (Ray's node table)."""
    ip_of = {n["node_id"]: n["node_ip"] for n in cluster.nodes()}
    return [ip_of[r["node_id"]] for r in sorted(topology["ranks"], key=lambda r: r["world_rank"])]


def read_topology(plan: TrialPlan) -> dict:
    with open(plan.topology_uri) as f:
        return json.load(f)


def assert_hosts_are_namespaces(cluster, job_id: str, plan: TrialPlan, hosts: int, per_host: int) -> None:
    """Every host rank of topology.json ran on its own worker namespace's address, and Ray Train
    saw the same workers there, with its node_rank (by IP) equal to the host rank (on a pool:
    Ray's actor table has each rank's process on that address); each host read its own files
    and together all of them."""
    topology = read_topology(plan)
    ranks = sorted(topology["ranks"], key=lambda r: r["world_rank"])
    ips = node_ips(cluster, topology)
    worker_addresses = {h.address for name, h in cluster.hosts.items() if name != "head"}
    assert [(r["host_rank"], r["local_rank"]) for r in ranks] == [
        (w // per_host, w % per_host) for w in range(hosts * per_host)
    ]
    assert len(set(ips)) == hosts and set(ips) <= worker_addresses
    assert all(ips[w] == ips[w - w % per_host] for w in range(len(ips)))  # a host's ranks share its IP

    if plan.study.scaling.reuse_workers:
        ran = pool_ranks(cluster, job_id)
        assert [ran.get(r["pid"]) for r in ranks] == ips
    else:
        workers = train_attempts(cluster, job_id)[-1]
        assert [w["node_ip"] for w in workers] == ips
        assert [w["pid"] for w in workers] == [r["pid"] for r in ranks]
        assert [w["node_rank"] for w in workers] == [r["host_rank"] for r in ranks]

    opened = [set().union(*(r["train_files"] for r in ranks if r["host_rank"] == h)) for h in range(hosts)]
    assert sum(len(o) for o in opened) == len(set().union(*opened))  # disjoint
    assert set().union(*opened) == {f.uri for f in list_files(str(plan.study.data.train))}


# 3 hosts x 1 worker, losing a host mid-trial (after the 2 x 2 layout).

STEPS, EVERY = 300, 50


def test_two_hosts_of_two_workers(cluster, digits_dir, tmp_path):
    raw = one_trial_study(digits_dir, tmp_path / "storage", "twobytwo", 2, 2, 100, 50)
    job_id = cluster.submit_study(raw, tmp_path / "work")
    ref_raw = one_trial_study(digits_dir, tmp_path / "ref-storage", "twobytwo", 2, 2, 100, 50)
    reference = reference_run(ref_raw, tmp_path / "ref")  # trains while the job does
    finish(cluster, job_id)
    plan = plan_of(raw)
    assert_hosts_are_namespaces(cluster, job_id, plan, hosts=2, per_host=2)
    assert_same_trial(plan, reference)


def registered_steps(plan: TrialPlan) -> list[int]:
    """Steps of the checkpoints Ray Train's controller took in (its snapshot on storage)."""
    try:
        with open(os.path.join(plan.trial_uri, "checkpoint_manager_snapshot.json")) as f:
            return [r["metrics"]["step"] for r in json.load(f)["checkpoint_results"]]
    except (OSError, ValueError, KeyError):
        return []


CONTROL_ACTORS = ("TrainController", "ImplicitFunc", "TuneRun", "Coordinator")
"""Ray process titles of the actors that drive a trial: Ray Train's controller, the Tune trial,
the study's Tune run and coordinator."""


def process_titles(namespace: str) -> list[str]:
    titles = []
    for pid in netns_cluster.namespace_pids(namespace):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline") as f:
            titles.append(f.read())
    return titles


def node_state(cluster, address: str) -> str:
    return next(n["state"] for n in cluster.nodes() if n["node_ip"] == address)


def training_only_host(cluster, plan: TrialPlan) -> str:
    """A worker host of world rank 1 or 2 that runs no Ray Train controller and no Tune actor,
    only training workers (the host a training job loses most often)."""
    ips = node_ips(cluster, read_topology(plan))
    for ip in ips[1:]:
        name = next(n for n, h in cluster.hosts.items() if h.address == ip)
        titles = " ".join(process_titles(cluster.hosts[name].namespace))
        if not any(actor in titles for actor in CONTROL_ACTORS):
            return name
    raise AssertionError(f"every host of ranks 1.. runs a controller: {ips}")


@pytest.mark.parametrize("layout", ["pool", "ray-train"])
def test_a_killed_host_is_replaced_and_the_trial_resumes(cluster, digits_dir, tmp_path, layout):
    """The trial on 3 hosts x 1 worker, on a pool of reused workers (the default) and as a Ray
    Train run; every process of a worker host SIGKILLed once a checkpoint is resumable (its
    link stays up: peers see its sockets reset), a replacement host added once Ray marks the
    node dead: the trial resumes from its latest resumable checkpoint on the new host, runs on 3
    namespaces again (checked as the other layouts are), and ends bitwise equal to the
    uninterrupted reference. Prints what the loss cost."""
    pool = layout == "pool"

    def study(storage):
        return one_trial_study(digits_dir, storage, "hostlost", 3, 1, STEPS, EVERY, layout)

    raw = study(tmp_path / "storage")
    plan = plan_of(raw)
    job_id = cluster.submit_study(raw, tmp_path / "work")
    # What a restart resumes from: the pool's trial reads its committed checkpoints; a Ray Train
    # run those its controller registered.
    resumable = (lambda: committed_steps(plan.trial_uri)) if pool else (lambda: registered_steps(plan))
    registered = wait_for("resumable checkpoint", resumable, JOB_TIMEOUT_S, 0.05)
    victim = training_only_host(cluster, plan)
    logged = read_log(plan)[-1]["step"]
    address = cluster.hosts[victim].address
    killed_at = time.time()
    assert cluster.kill_host(victim)
    wait_for("node marked dead", lambda: node_state(cluster, address) == "DEAD", 60)
    detected_s = time.time() - killed_at
    assert logged < STEPS, f"the trial ended (step {logged}) before its host was killed"
    cluster.add_host(f"{victim}-new")
    resumed = wait_for("resumed trial", lambda: resumed_from(plan), JOB_TIMEOUT_S)
    resumed_s = time.time() - killed_at
    reference = reference_run(study(tmp_path / "ref-storage"), tmp_path / "ref")  # trains while the job ends
    logs = finish(cluster, job_id)
    assert f"best trial: {TRIAL}" in logs

    ranks = read_topology(plan)["ranks"]
    ips = node_ips(cluster, read_topology(plan))
    assert address not in ips and cluster.hosts[f"{victim}-new"].address in ips
    assert max(registered) <= resumed == ranks[0]["resumed_from_step"] <= logged
    if pool:
        assert address in pool_ranks(cluster, job_id).values()  # the first attempt ran there
    else:
        attempts = train_attempts(cluster, job_id)
        assert address in [w["node_ip"] for w in attempts[0]] and [w["node_ip"] for w in attempts[-1]] == ips
    assert_hosts_are_namespaces(cluster, job_id, plan, hosts=3, per_host=1)
    assert_same_trial(plan, reference)
    print(
        f"{layout}: host lost: node marked dead {detected_s:.1f} s after the kill; training resumed from "
        f"step {resumed} {resumed_s:.1f} s after it; steps recomputed: {logged - resumed} to "
        f"{logged + EVERY - 1 - resumed} (the kill came between steps {logged} and {logged + EVERY}); "
        f"the job ran {job_seconds(cluster, job_id):.1f} s"
    )


def shard_files(plan: TrialPlan, step: int) -> dict[str, bytes]:
    folder = pathlib.Path(plan.trial_uri) / f"checkpoint_{step:08d}" / "model"
    return {p.name: p.read_bytes() for p in folder.glob("__*.distcp")}


def test_a_killed_host_of_an_fsdp_trial_resumes_from_its_sharded_checkpoint(cluster, digits_dir, tmp_path):
    """The same loss under `strategy: fsdp` (3 hosts x 1 worker, the model sharded over them):
    every process of a worker host SIGKILLed once a sharded checkpoint is committed, a
    replacement added; every rank reads its part of that checkpoint and the trial ends bitwise
    equal to the same trial in gloo processes (every evaluation, the kept checkpoints' shards)."""
    from tests.helpers.fsdp_runs import train_rank

    def fsdp_study(storage):
        raw = one_trial_study(digits_dir, storage, "fsdphost", 3, 1, STEPS, EVERY)
        raw["scaling"]["strategy"] = "fsdp"
        return raw

    raw = fsdp_study(tmp_path / "storage")
    plan = plan_of(raw)
    job_id = cluster.submit_study(raw, tmp_path / "work")
    committed = wait_for("sharded checkpoint", lambda: committed_steps(plan.trial_uri), JOB_TIMEOUT_S, 0.05)
    victim = training_only_host(cluster, plan)
    logged, address = read_log(plan)[-1]["step"], cluster.hosts[victim].address
    assert cluster.kill_host(victim)
    wait_for("node marked dead", lambda: node_state(cluster, address) == "DEAD", 60)
    assert logged < STEPS, f"the trial ended (step {logged}) before its host was killed"
    cluster.add_host(f"{victim}-new")
    reference = plan_of(fsdp_study(tmp_path / "ref-storage"))
    (tmp_path / "ref").mkdir()
    run_gloo(train_rank, 3, tmp_path / "ref", reference, None, True)  # trains while the job ends its trial
    finish(cluster, job_id)

    ranks = read_topology(plan)["ranks"]
    assert address not in node_ips(cluster, read_topology(plan))
    assert max(committed) <= ranks[0]["resumed_from_step"] <= logged
    assert [without_timing(r) for r in read_log(plan)] == [without_timing(r) for r in read_log(reference)]
    assert committed_steps(plan.trial_uri) == committed_steps(reference.trial_uri)
    for step in committed_steps(plan.trial_uri):
        assert len(shard_files(plan, step)) == 3 and shard_files(plan, step) == shard_files(reference, step)
