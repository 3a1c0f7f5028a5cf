"""The attempt fence where it matters, on real hosts (tests/helpers/netns_cluster.py): a
one-worker (fast path) trial has no collective that could fail when its host drops off the
network, so its process trains on. Here the link of its host goes down while the trial runs;
Ray declares the node dead (health checks 1 s apart, netns_cluster.HEALTH_CHECK) and Tune
starts a new attempt of the trial on the other host, which claims the trial
(`distributed.fence`). The stranded process is held (SIGSTOP) from the cut until that claim,
so that its next write surely comes after it, as on a host slower than the replacement's
start; then it trains on to its next evaluation while still cut off, with storage in reach.
Every write it then tries into the trial folder is refused (the storage audit,
PLAYBOOK_STORAGE_AUDIT, lists it as `refused <uri>` and lists no write), the link comes back,
the stranded host's processes end, and the trial ends with one row in the trial table, bitwise
equal to the same trial trained uninterrupted in this process."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import time

import pyarrow.parquet as pq
import pytest

from service.core import storage
from service.planning.trial import TrialPlan
from service.study import spec
from tests.helpers import netns_cluster
from tests.helpers.one_worker_trials import (
    assert_same_trial,
    attempt_of,
    committed_steps,
    logged_steps,
    reference_run,
    resumed_from,
    wait_for,
)
from tests.helpers.ray_head import wait_for_job
from tests.helpers.studies import study_dict

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]
HPARAMS = {"learning_rate": 0.05, "momentum": 0.9, "width": 4}
TRIAL = "explore-0000"
HOSTS = ["h1", "h2"]  # the trial runs on one; its new attempt on the other
STEPS, EVERY = 3000, 500
JOB_TIMEOUT_S = 480


def study_raw(digits_dir, storage_dir) -> dict:
    return study_dict(
        digits_dir,
        storage_dir,
        name="fenced",
        training={"max_train_steps": STEPS, "eval_every_steps": EVERY, "schedule": {"kind": "constant"}},
        search={k: {"role": "fixed", "value": v} for k, v in HPARAMS.items()},
        rounds=[{"name": "explore", "num_trials": 1}],
    )


def plan_of(raw: dict) -> TrialPlan:
    return TrialPlan(spec.load_dict(raw), TRIAL, "explore", dict(HPARAMS), STEPS)


def audited(audit: pathlib.Path, pids: list[int]) -> list[str]:
    """The storage audit's lines of `pids`: the URIs each wrote, and `refused <uri>` for each
    write the fence refused."""
    lines = []
    for pid in pids:
        with contextlib.suppress(FileNotFoundError):
            lines += (audit / f"{pid}.log").read_text().splitlines()
    return lines


def alive(pid: int) -> bool:
    """Running (an exited child not yet reaped, a zombie, is not)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def node_state(cluster, host: str) -> str:
    address = cluster.hosts[host].address
    return next(n["state"] for n in cluster.nodes() if n["node_ip"] == address)


def test_a_stranded_single_worker_attempt_writes_nothing_into_its_trial(digits_dir, tmp_path):
    reason = netns_cluster.skip_reason()
    if reason:
        pytest.skip(reason)
    audit = tmp_path / "audit"
    audit.mkdir()
    raw = study_raw(digits_dir, tmp_path / "storage")
    plan = plan_of(raw)
    t0 = time.monotonic()
    cluster = netns_cluster.NetnsCluster(tmp_path / "netns")
    cluster.env[storage.AUDIT_ENV] = str(audit)
    try:
        cluster.make_bridge()
        cluster.start_head()
        for name in HOSTS:
            cluster.add_host(name, cpus=1)
        job_id = cluster.submit_study(raw, tmp_path / "work")
        wait_for("committed checkpoint", lambda: committed_steps(plan.trial_uri), JOB_TIMEOUT_S, 0.1)
        first = attempt_of(plan)
        cut = next(name for name, h in cluster.hosts.items() if h.namespace == first.host)
        stranded = netns_cluster.namespace_pids(cluster.hosts[cut].namespace)
        os.kill(first.pid, signal.SIGSTOP)  # the trial's own process, which holds attempt 1
        cluster.link_down(cut)
        cut_at = {"committed": committed_steps(plan.trial_uri), "logged": max(logged_steps(plan), default=0)}
        assert cut_at["logged"] <= STEPS - 2 * EVERY, "the trial was nearly over before the cut"
        written_before = audited(audit, stranded)
        down = time.monotonic()
        wait_for("node marked dead", lambda: node_state(cluster, cut) == "DEAD", 120, 0.5)
        dead_s = time.monotonic() - down
        second = wait_for("new attempt", lambda: (a := attempt_of(plan)) and a.attempt >= 2 and a, 300, 0.2)
        claimed_s = time.monotonic() - down
        os.kill(first.pid, signal.SIGCONT)  # trains on to its next evaluation, still cut off
        late = wait_for("stranded write", lambda: audited(audit, stranded)[len(written_before) :], 300, 0.2)
        cluster.link_up(cut)
        with contextlib.suppress(AssertionError):
            wait_for("stranded processes to end", lambda: not any(alive(p) for p in stranded), 120, 0.5)
        survivors = [p for p in stranded if alive(p)]
        ref_plan = plan_of(study_raw(digits_dir, tmp_path / "ref-storage"))
        ref_checkpoints = reference_run(ref_plan, tmp_path / "ref")  # trains while the job ends
        state, logs = wait_for_job(cluster.dashboard, job_id, cluster.env, timeout_s=JOB_TIMEOUT_S)
        (tmp_path / "job.log").write_text(logs)
        assert state == "SUCCEEDED", logs[-4000:]
    finally:
        cluster.close()
    late = audited(audit, stranded)[len(written_before) :]
    assert late and all(line.startswith(f"refused {plan.trial_uri}/") for line in late), late
    assert survivors == []
    assert second.host != first.host and max(cut_at["committed"]) <= resumed_from(plan) <= cut_at["logged"]
    rows = pq.read_table(f"{plan.study.study_uri}/trials.parquet").to_pylist()
    assert [(r["trial_name"], r["status"]) for r in rows] == [(TRIAL, "FINISHED")]
    assert_same_trial(plan, ref_plan, ref_checkpoints)
    print(
        f"\n{cut} cut off at step {cut_at['logged']}: node dead after {dead_s:.1f} s, attempt "
        f"{second.attempt} claimed the trial on {second.host} after {claimed_s:.1f} s and resumed from "
        f"step {resumed_from(plan)}; the stranded attempt's writes, all refused: {late}; "
        f"the whole test {time.monotonic() - t0:.0f} s"
    )
