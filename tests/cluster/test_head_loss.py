"""The head lost on real hosts (tests/helpers/netns_cluster.py): mid-study, every process of the
head's namespace (Ray's GCS, the job's driver, the study's coordinator and Tune run) is
SIGKILLed at once. The worker host's Ray gives up on the dead GCS and exits by itself (its
trial process with it); a new head is started, the worker host joins it, and the same `ray job
submit ... playbook run study.yaml` is sent again over the same storage. The finished trial's
folder is left as it was (every byte and mtime), the trial that was cut resumes from its latest
committed checkpoint, and both end bitwise equal to the same trials trained uninterrupted in
this process."""

from __future__ import annotations

import contextlib
import time

import pyarrow.parquet as pq
import pytest

from service.planning.trial import TrialPlan
from service.study import spec
from tests.helpers import netns_cluster
from tests.helpers.one_worker_trials import (
    assert_same_trial,
    committed_steps,
    logged_steps,
    reference_run,
    resumed_from,
    wait_for,
)
from tests.helpers.ray_head import wait_for_job
from tests.helpers.studies import folder_state, study_dict

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]
STEPS, EVERY = 3000, 500
LEARNING_RATES = [0.05, 0.1]
TRIALS = ["explore-0000", "explore-0001"]
GCS_RECONNECT_TIMEOUT_S = 15
"""How long the worker host's Ray waits for a lost GCS before it exits (Ray's default: 60 s).
Set in the hosts' environment (`RAY_gcs_rpc_server_reconnect_timeout_s`), not the head's system
config: a raylet makes its GCS client before it reads the cluster's config from the GCS."""
JOB_TIMEOUT_S = 480


def study_raw(digits_dir, storage_dir) -> dict:
    """Two one-worker trials, one after the other (the worker host has one CPU)."""
    return study_dict(
        digits_dir,
        storage_dir,
        name="headloss",
        training={"max_train_steps": STEPS, "eval_every_steps": EVERY, "schedule": {"kind": "constant"}},
        search={
            "learning_rate": {"role": "nuisance", "type": "choice", "values": LEARNING_RATES},
            "momentum": {"role": "fixed", "value": 0.9},
            "width": {"role": "fixed", "value": 4},
        },
        rounds=[{"name": "explore", "kind": "grid", "num_trials": 2, "max_concurrent_trials": 1}],
    )


def plans_of(raw: dict) -> list[TrialPlan]:
    study = spec.load_dict(raw)
    return [
        TrialPlan(study, name, "explore", {"learning_rate": lr, "momentum": 0.9, "width": 4}, STEPS)
        for name, lr in zip(TRIALS, LEARNING_RATES, strict=True)
    ]


def statuses(study_uri: str) -> dict[str, str]:
    with contextlib.suppress(OSError, ValueError):
        rows = pq.read_table(f"{study_uri}/trials.parquet").to_pylist()
        return {r["trial_name"]: r["status"] for r in rows}
    return {}


def cut_point(study_uri: str, last: TrialPlan) -> bool:
    """The first trial is finished (in the trial table) and the last one has a committed
    checkpoint with at least two evaluations still ahead of it."""
    logged = logged_steps(last)
    return (
        statuses(study_uri).get(TRIALS[0]) == "FINISHED"
        and bool(committed_steps(last.trial_uri))
        and max(logged, default=0) <= STEPS - 2 * EVERY
    )


AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


def processes_in(namespace: str) -> dict[int, str]:
    """What still runs in `namespace`: pid -> command line."""
    out = {}
    for pid in netns_cluster.namespace_pids(namespace):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            out[pid] = f.read().replace(b"\0", b" ").decode().strip()[:200]
    return out


def test_a_lost_head_is_replaced_and_the_resubmitted_study_resumes(digits_dir, tmp_path):
    reason = netns_cluster.skip_reason()
    if reason:
        pytest.skip(reason)
    raw = study_raw(digits_dir, tmp_path / "storage")
    first, last = plans_of(raw)
    study_uri = first.study.study_uri
    t0 = time.monotonic()
    cluster = netns_cluster.NetnsCluster(tmp_path / "netns")
    cluster.env["RAY_gcs_rpc_server_reconnect_timeout_s"] = str(GCS_RECONNECT_TIMEOUT_S)
    try:
        cluster.make_bridge()
        cluster.start_head()
        worker = cluster.add_host("h1", cpus=1)
        cluster.submit_study(raw, tmp_path / "work")
        wait_for("cut point", lambda: cut_point(study_uri, last), JOB_TIMEOUT_S, 0.1)
        killed = cluster.kill_host("head")
        cut = {"committed": committed_steps(last.trial_uri), "logged": max(logged_steps(last))}
        finished = folder_state(first.trial_uri)
        lost = time.monotonic()
        worker.process.wait(timeout=180)  # `ray start --block` ends once its raylet gave up on the GCS
        left = processes_in(worker.namespace)
        # Ray's dashboard and runtime-env agents outlive their raylet; nothing else may.
        assert set(left.values()) <= set(AGENTS), left
        netns_cluster.kill_namespace(worker.namespace)
        worker_gone_s = time.monotonic() - lost
        # The trial process may commit one more checkpoint before its report to the dead Tune
        # run blocks: the rerun resumes from the latest one on storage.
        at_restart = committed_steps(last.trial_uri)
        cluster.restart_head()
        cluster.rejoin("h1", cpus=1)
        job_id = cluster.submit_study(raw, tmp_path / "work")
        ref_raw = study_raw(digits_dir, tmp_path / "ref-storage")
        references = [(p, reference_run(p, tmp_path / "ref" / p.trial_name)) for p in plans_of(ref_raw)]
        state, logs = wait_for_job(cluster.dashboard, job_id, cluster.env, timeout_s=JOB_TIMEOUT_S)
        (tmp_path / "job.log").write_text(logs)
        assert state == "SUCCEEDED", logs[-4000:]
    finally:
        cluster.close()
    assert killed and cut["logged"] <= STEPS - 2 * EVERY
    assert folder_state(first.trial_uri) == finished  # not run again, not written
    assert "round explore: resuming from" in logs
    assert max(cut["committed"]) <= max(at_restart) == resumed_from(last) < STEPS
    assert statuses(study_uri) == {t: "FINISHED" for t in TRIALS}  # one row each
    for plan, (ref_plan, ref_checkpoints) in zip((first, last), references, strict=True):
        assert_same_trial(plan, ref_plan, ref_checkpoints)
    print(
        f"\nhead lost with {TRIALS[0]} finished and {TRIALS[1]} at step {cut['logged']} (committed "
        f"{cut['committed']}); the worker host's Ray exited {worker_gone_s:.1f} s later; resumed from "
        f"step {resumed_from(last)}; the whole test {time.monotonic() - t0:.0f} s"
    )
