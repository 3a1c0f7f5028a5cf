"""A partition on real hosts (tests/helpers/netns_cluster.py): mid-trial, the link of the host
running rank 0 (the trial's writer) goes down for longer than Ray's failure detection, its
processes living on, unreachable; then it comes back. Nothing hangs: Ray marks the node dead,
Ray Train restarts the worker group on the hosts that remain (a spare host takes the lost one's
place), the new group claims the trial (`distributed.fence`) and resumes from the latest checkpoint,
and the study ends with the same metrics log and checkpoints as the trial trained without Ray or
a network (one gloo process per rank here). The stranded processes end once their host is back
(its raylet learns it was declared dead), and the storage audit shows that none of them wrote
into the study after the link came back."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import time
import urllib.request

import pytest

from service.core import storage
from service.distributed import checkpoint, fence
from service.distributed.topology import Topology
from service.planning.trial import TrialPlan
from service.study import spec
from tests.helpers import netns_cluster
from tests.helpers.one_worker_trials import committed_steps, logged_steps, wait_for
from tests.helpers.ray_head import wait_for_job
from tests.helpers.studies import TRIAL_LAYOUTS, same_nested, study_dict
from tests.helpers.trainer_runs import Reporter, read_log, without_timing

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]
HPARAMS = {"learning_rate": 0.05, "momentum": 0.9, "width": 4}
TRIAL = "explore-0000"
HOSTS = ["h1", "h2", "h3"]  # the trial runs on two; the third takes the cut one's place
STEPS, EVERY, CUT_AFTER_STEP = 400, 50, 100
COLLECTIVE_TIMEOUT_S = 20


@contextlib.contextmanager
def audited_cluster(tmp_path, audit: pathlib.Path):
    """Head + HOSTS (1 CPU each); every Ray process logs the storage URIs it writes to `audit`."""
    tmp_path.mkdir()
    cluster = netns_cluster.NetnsCluster(tmp_path)
    cluster.env[storage.AUDIT_ENV] = str(audit)
    # Every namespace shares this machine's hostname, which resolves to loopback: gloo must take
    # the address of the namespace's own interface.
    cluster.env["GLOO_SOCKET_IFNAME"] = "eth0"
    try:
        cluster.make_bridge()
        cluster.start_head()
        for name in HOSTS:
            cluster.add_host(name, cpus=1)
        yield cluster
    finally:
        cluster.close()


def study_raw(digits_dir, storage_dir, layout: str) -> dict:
    return study_dict(
        digits_dir,
        storage_dir,
        name="partition",
        # On a pool of reused workers (the default; world rank 0 is the Tune trial's own
        # process) or as a Ray Train run of its own.
        scaling={
            **TRIAL_LAYOUTS[layout],
            "num_hosts": 2,
            "workers_per_host": 1,
            "collective_timeout_s": COLLECTIVE_TIMEOUT_S,
        },
        training={"max_train_steps": STEPS, "eval_every_steps": EVERY},
        search={k: {"role": "fixed", "value": v} for k, v in HPARAMS.items()},
        rounds=[{"name": "explore", "num_trials": 1}],
    )


def plan_of(raw: dict) -> TrialPlan:
    study = spec.load_dict(raw)
    return TrialPlan(study, TRIAL, "explore", dict(HPARAMS), study.training.max_train_steps)


def reference_rank(rank: int, world: int, raw: dict, store: str) -> list[str]:
    import torch

    from service.trainer.loop import train

    torch.set_num_threads(1)
    topo = Topology(world_rank=rank, world_size=world, host_rank=rank, num_hosts=world)
    reporter = Reporter(pathlib.Path(store))
    train(plan_of(raw), topo, reporter)
    return [d for _, d in reporter.reports if d]


def reference_run(raw: dict, tmp_path) -> tuple[TrialPlan, dict[int, str]]:
    """The same trial, uninterrupted, in two gloo processes: (plan, {step: checkpoint folder})."""
    from tests.helpers.gloo import run_gloo

    folders = run_gloo(reference_rank, 2, tmp_path, raw, str(tmp_path))[0]
    return plan_of(raw), {checkpoint.step_of(d): d for d in folders}


def resumable_steps(plan: TrialPlan, layout: str) -> list[int]:
    """Steps a restarted trial can resume from: the checkpoints Ray Train's controller
    registered (its snapshot), or on a pool the trial's committed checkpoints on storage."""
    if layout == "pool":
        return committed_steps(plan.trial_uri)
    with contextlib.suppress(OSError, ValueError, KeyError):
        with open(os.path.join(plan.trial_uri, "checkpoint_manager_snapshot.json")) as f:
            return [r["metrics"]["step"] for r in json.load(f)["checkpoint_results"]]
    return []


def host_of_rank0(cluster, plan: TrialPlan) -> str:
    with open(plan.topology_uri) as f:
        rank0 = next(r for r in json.load(f)["ranks"] if r["world_rank"] == 0)
    ip = next(n["node_ip"] for n in cluster.nodes() if n["node_id"] == rank0["node_id"])
    return next(name for name, h in cluster.hosts.items() if h.address == ip)


def hosts_of_actors(cluster, class_name: str) -> set[str]:
    """The hosts that alive actors of `class_name` run on (Ray's state API)."""
    req = urllib.request.Request(
        f"{cluster.dashboard}/api/v0/actors?limit=1000&detail=true",
        headers={"Authorization": f"Bearer {cluster.env['RAY_AUTH_TOKEN']}"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        actors = json.load(r)["data"]["result"]["result"]
    ip_of = {n["node_id"]: n["node_ip"] for n in cluster.nodes()}
    name_of = {h.address: name for name, h in cluster.hosts.items()}
    alive = [a for a in actors if a["class_name"] == class_name and a["state"] == "ALIVE"]
    return {name_of[ip_of[a["node_id"]]] for a in alive}


def node_state(cluster, host: str) -> str:
    return next(n["state"] for n in cluster.nodes() if n["node_ip"] == cluster.hosts[host].address)


def attempt_number(plan: TrialPlan) -> int:
    current = fence.read(plan.trial_uri)
    return current.attempt if current else 0


def command_of(pid: int) -> str:
    with contextlib.suppress(OSError):
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    return ""


def alive(pid: int) -> bool:
    """Running (an exited child not yet reaped, a zombie, is not)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def kept_checkpoints(plan: TrialPlan) -> dict[int, str]:
    names = [d for d in os.listdir(plan.trial_uri) if d.startswith("checkpoint_")]
    folders = [os.path.join(plan.trial_uri, d) for d in names]
    return {checkpoint.step_of(d): d for d in folders if checkpoint.is_complete(d)}


def assert_same_trial(plan: TrialPlan, reference: tuple[TrialPlan, dict[int, str]]) -> None:
    """Metrics log (without timings) and every kept checkpoint equal the reference's."""
    ref_plan, ref_checkpoints = reference
    assert [without_timing(r) for r in read_log(plan)] == [without_timing(r) for r in read_log(ref_plan)]
    kept = kept_checkpoints(plan)
    assert STEPS in kept and set(kept) <= set(ref_checkpoints)
    for step, folder in kept.items():
        got, want = checkpoint.load(folder), checkpoint.load(ref_checkpoints[step])
        history = [[without_timing(r) for r in s.history] for s in (got, want)]
        assert history[0] == history[1], step
        got.history, want.history = [], []
        assert same_nested(vars(got), vars(want)), step


@pytest.mark.parametrize("layout", ["pool", "ray-train"])
def test_a_partitioned_host_fails_the_trial_over_and_writes_nothing_when_it_returns(
    digits_dir, tmp_path, layout
):
    reason = netns_cluster.skip_reason()
    if reason:
        pytest.skip(reason)
    audit = tmp_path / "audit"
    audit.mkdir()
    raw = study_raw(digits_dir, tmp_path / "storage", layout)
    plan = plan_of(raw)
    with audited_cluster(tmp_path / "netns", audit) as cluster:
        job_id = cluster.submit_study(raw, tmp_path / "work")
        wait_for("resumable checkpoint", lambda: CUT_AFTER_STEP in resumable_steps(plan, layout), 480)
        resumable = max(resumable_steps(plan, layout))
        cut = host_of_rank0(cluster, plan)
        # The study's coordinator and its Tune run live with the driver on the head: a lost
        # worker host costs trials, never the study.
        assert hosts_of_actors(cluster, "Coordinator") == hosts_of_actors(cluster, "TuneRun") == {"head"}
        stranded = netns_cluster.namespace_pids(cluster.hosts[cut].namespace)
        cut_at_step = max(logged_steps(plan))
        assert cut_at_step < STEPS, "the trial ended before the cut"
        cluster.link_down(cut)
        down = time.monotonic()
        wait_for("node marked dead", lambda: node_state(cluster, cut) == "DEAD", 120, 0.5)
        detected_s = time.monotonic() - down
        wait_for("restarted trial", lambda: attempt_number(plan) >= 2, 300, 0.5)
        restarted_s = time.monotonic() - down
        assert all(alive(p) for p in stranded[:1])  # still running, unreachable
        cluster.link_up(cut)
        up = time.time()
        with contextlib.suppress(AssertionError):
            wait_for("stranded processes to end", lambda: not any(alive(p) for p in stranded), 120, 0.5)
        survivors = {p: command_of(p) for p in stranded if alive(p)}
        assert survivors == {}, survivors
        ended_s = time.time() - up
        state, logs = wait_for_job(cluster.dashboard, job_id, cluster.env, timeout_s=480)
        (tmp_path / "job.log").write_text(logs)
        assert state == "SUCCEEDED", logs[-4000:]
    with open(plan.topology_uri) as f:
        resumed_from = json.load(f)["ranks"][0]["resumed_from_step"]
    (tmp_path / "reference").mkdir()
    reference = reference_run(
        study_raw(digits_dir, tmp_path / "reference-storage", layout), tmp_path / "reference"
    )
    assert_same_trial(plan, reference)
    assert resumable <= resumed_from <= cut_at_step  # from the latest checkpoint, not from scratch
    logs_of = {p: audit / f"{p}.log" for p in stranded}
    late = [p for p, log in logs_of.items() if log.exists() and log.stat().st_mtime > up]
    assert late == [], "stranded processes wrote after their host came back"
    print(
        f"\n{layout}: partition of {cut}: node dead after {detected_s:.1f} s, trial restarted (claimed the "
        f"trial) after {restarted_s:.1f} s, stranded processes ended {ended_s:.1f} s after the link came "
        f"back; cut after step {cut_at_step} (latest resumable checkpoint: step {resumable}), resumed "
        f"from step {resumed_from}"
    )
