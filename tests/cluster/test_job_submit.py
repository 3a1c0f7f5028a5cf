"""`ray job submit -- playbook run study.yaml` against a `ray start --head` with token auth,
started by the test with its own temp dir and ports: the job succeeds and the trial rows exist;
the KubeRay RayJob's own entrypoint and study file (gs:// on an emulator) run the same way."""

from __future__ import annotations

import io
import os
import re
import secrets
import shlex
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
import yaml

from service.study import spec
from tests.helpers import kuberay
from tests.helpers.gcs import emulator_env, list_objects, read_object
from tests.helpers.ray_head import BIN, job_logs, job_state, start_ray_head, wait_for_job
from tests.helpers.studies import folder_state, study_dict

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


@pytest.fixture
def ray_head(tmp_path):
    with start_ray_head(tmp_path) as head:
        yield head


def test_job_submit_runs_the_study(ray_head, digits_dir, tmp_path):
    address, gcs_address, env = ray_head
    storage = tmp_path / "storage"
    work = tmp_path / "work"
    work.mkdir()
    # Long enough (about ten seconds per trial on the single-worker fast path) for a status
    # call, which connects to the cluster each time, to find the coordinator running: the
    # calls start once the first trial has (its topology.json), with both trials' training left.
    steps = 12000
    study = study_dict(
        digits_dir, storage, name="submitted", training={"max_train_steps": steps, "eval_every_steps": 3000}
    )
    (work / "study.yaml").write_text(yaml.safe_dump(study))

    submit = [
        f"{BIN}/ray",
        "job",
        "submit",
        "--no-wait",
        "--address",
        address,
        "--working-dir",
        str(work),
        "--",
        "playbook",
        "run",
        "study.yaml",
    ]
    out = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    job_id = re.search(r"raysubmit_\w+", out.stdout + out.stderr).group(0)

    # While it runs, `playbook status` (a laptop with RAY_ADDRESS) asks the live coordinator.
    status_env = {**env, "RAY_ADDRESS": gcs_address}
    seen_live, state = False, ""
    first_trial = storage / "submitted" / "trials" / "explore-0000" / "topology.json"
    deadline = time.time() + 480
    while time.time() < deadline:
        state = job_state(address, job_id, env)
        if state in ("SUCCEEDED", "FAILED", "STOPPED"):
            break
        if not seen_live and os.path.exists(first_trial):
            st = subprocess.run(
                [sys.executable, "-m", "service", "status", "submitted", "--storage", str(storage)],
                env=status_env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            seen_live = st.returncode == 0 and "study submitted: running" in st.stdout
        time.sleep(0.5)
    logs = job_logs(address, job_id, env)
    assert state == "SUCCEEDED", logs[-4000:]
    assert seen_live, "playbook status never reached the running coordinator"
    assert "best trial: explore-000" in logs
    for noise in ("Traceback", "Exception ignored", "FutureWarning"):  # nothing a user reads as failure
        assert noise not in logs, logs[-4000:]
    # The job's own log (after `ray job logs`' coloured header) is the study's lines, plain: none
    # of Tune's chatter, no colour, no Ray prefix on them.
    job_log = logs.split("Running entrypoint for job", 1)[1]
    for noise in ("╭", "Wrote the latest version", "\x1b[", "(Coordinator pid="):
        assert noise not in job_log, job_log[-4000:]
    assert "[explore-0000] started: " in job_log and "[explore-0001] finished: best " in job_log

    rows = pq.read_table(str(storage / "submitted" / "trials.parquet")).to_pylist()
    assert sorted(r["trial_name"] for r in rows) == ["explore-0000", "explore-0001"]
    assert all(r["status"] == "FINISHED" and r["step"] == steps for r in rows)

    # The job ran with the auth token, but it is in neither the job log nor any stored file.
    token = env["RAY_AUTH_TOKEN"]
    assert token not in logs
    for folder, _, files in os.walk(storage):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                assert token.encode() not in f.read(), os.path.join(folder, name)

    # Token auth is really on: a client with the wrong token is refused.
    wrong = {**env, "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    refused = subprocess.run(
        [f"{BIN}/ray", "job", "list", "--address", address],
        env=wrong,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Invalid authentication token" in refused.stdout + refused.stderr

    # The study grows: the same file with a round appended, submitted again, runs that round
    # alone; round 1's trial folders are not written to.
    explore = {
        n: folder_state(storage / "submitted" / "trials" / n) for n in ("explore-0000", "explore-0001")
    }
    study["rounds"].append({"name": "more", "num_trials": 1, "max_train_steps": 100})
    (work / "study.yaml").write_text(yaml.safe_dump(study))
    out = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    job_id = re.search(r"raysubmit_\w+", out.stdout + out.stderr).group(0)
    deadline = time.time() + 300
    while (
        job_state(address, job_id, env) not in ("SUCCEEDED", "FAILED", "STOPPED") and time.time() < deadline
    ):
        time.sleep(0.5)
    logs = job_logs(address, job_id, env)
    assert job_state(address, job_id, env) == "SUCCEEDED", logs[-4000:]
    assert "2 of 2 trials already done" in logs and "round more: 1 trial," in logs, logs[-4000:]
    rows = pq.read_table(str(storage / "submitted" / "trials.parquet")).to_pylist()
    assert sorted(r["trial_name"] for r in rows) == ["explore-0000", "explore-0001", "more-0000"]
    assert all(r["status"] == "FINISHED" for r in rows)
    assert {n: folder_state(storage / "submitted" / "trials" / n) for n in explore} == explore


def test_rayjob_entrypoint_runs_on_a_token_auth_head(tmp_path):
    """deploy/kuberay/rayjob.yaml's entrypoint, with the ConfigMap's study file where the
    manifest mounts it (here under tmp_path) and its gs:// storage and data on an emulator,
    through `ray job submit`; then `playbook status` from a laptop reads the study's storage."""
    job, config = kuberay.find("RayJob"), kuberay.find("ConfigMap")
    head_pod = dict(kuberay.pod_templates(job["spec"]["rayClusterSpec"]))["head"]
    (mount,) = kuberay.configmap_mounts(head_pod, config["metadata"]["name"])
    local = tmp_path / "configmap"
    local.mkdir()
    for key, text in config["data"].items():
        (local / key).write_text(text)
    entrypoint = shlex.split(job["spec"]["entrypoint"])
    argv = [str(local) + a[len(mount) :] if a.startswith(mount + "/") else a for a in entrypoint]
    assert argv != entrypoint, "the entrypoint reads nothing from the ConfigMap"
    study = spec.load_text(config["data"][os.path.basename(argv[-1])])
    bucket = study.storage.removeprefix("gs://").split("/")[0]
    data_root = os.path.dirname(study.data.train)
    assert {study.data.validation, study.data.test} == {f"{data_root}/validation", f"{data_root}/test"}

    with emulator_env(bucket, tmp_path / "gcs.log") as gcs_env:
        client_env = {**os.environ, **gcs_env}
        client_env.pop("RAY_ADDRESS", None)
        client_env.pop("RAY_AUTH_TOKEN", None)
        subprocess.run(
            [sys.executable, "-m", "service", "data", "digits", data_root],
            env=client_env,
            check=True,
            capture_output=True,
            timeout=300,
        )
        with start_ray_head(tmp_path, gcs_env) as (address, _, env):
            submit = [f"{BIN}/ray", "job", "submit", "--no-wait", "--address", address, "--", *argv]
            out = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
            job_id = re.search(r"raysubmit_\w+", out.stdout + out.stderr).group(0)
            state, logs = wait_for_job(address, job_id, env, timeout_s=480)
            assert state == "SUCCEEDED", logs[-4000:]

        # The laptop: another process, no RAY_ADDRESS and no cluster token, only the storage.
        status = subprocess.run(
            [sys.executable, "-m", "service", "status", study.name, "--storage", study.storage],
            env=client_env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert status.returncode == 0, status.stderr[-3000:]
        # ... and `playbook report` of the study URI writes the HTML report beside it on gs://.
        report = subprocess.run(
            [sys.executable, "-m", "service", "report", f"{study.storage}/{study.name}"],
            env=client_env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert report.returncode == 0, report.stderr[-3000:]

        # What the job wrote, read straight from the emulator's JSON API.
        endpoint = gcs_env["STORAGE_EMULATOR_HOST"]
        study_uri = f"{study.storage}/{study.name}"
        rows = pq.read_table(io.BytesIO(read_object(endpoint, f"{study_uri}/trials.parquet"))).to_pylist()
        assert sorted(r["trial_name"] for r in rows) == ["explore-0000", "explore-0001"]
        steps = study.training.max_train_steps
        assert all(r["status"] == "FINISHED" and r["step"] == steps for r in rows)
        stored = list_objects(endpoint, study_uri)
        for r in rows:  # each trial's best checkpoint went to gs:// from the training worker
            assert any(u.startswith(r["best_checkpoint"] + "/") for u in stored), r["best_checkpoint"]
        page = read_object(endpoint, f"{study_uri}/report.html").decode()
        assert all(r["trial_name"] in page for r in rows) and page.count("data:image/png;base64,") >= 3

    assert f"study {study.name}: finished; stored at {study.storage}/{study.name}" in status.stdout
    best = min(rows, key=lambda r: r["best_metric"])
    assert f"best trial: {best['trial_name']} " in status.stdout, status.stdout
    assert f"best trial: {best['trial_name']} " in logs
