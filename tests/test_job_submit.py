"""`ray job submit -- playbook run study.yaml` against a `ray start --head` with token auth,
started by the test with its own temp dir and ports: the job succeeds and the trial rows exist."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import free_ports, session_pids, study_dict

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]
BIN = os.path.dirname(sys.executable)


@pytest.fixture
def ray_head(tmp_path):
    """A token-auth Ray head in its own session; all of its processes are killed afterwards."""
    ports = free_ports(12)
    token = secrets.token_hex(16)
    temp_dir = f"/tmp/rh-{secrets.token_hex(3)}"  # short: Ray's socket paths have a length limit
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": token,
        "PATH": f"{BIN}:{os.environ['PATH']}",
    }
    env.pop("RAY_ADDRESS", None)
    cmd = [
        f"{BIN}/ray",
        "start",
        "--head",
        "--block",
        "--disable-usage-stats",
        "--num-cpus",
        "2",
        "--include-dashboard=true",
        "--temp-dir",
        temp_dir,
        "--port",
        str(ports[0]),
        "--dashboard-port",
        str(ports[1]),
        "--dashboard-agent-listen-port",
        str(ports[2]),
        "--dashboard-agent-grpc-port",
        str(ports[3]),
        "--runtime-env-agent-port",
        str(ports[4]),
        "--metrics-export-port",
        str(ports[5]),
        "--ray-client-server-port",
        str(ports[6]),
        "--node-manager-port",
        str(ports[7]),
        "--object-manager-port",
        str(ports[8]),
        "--min-worker-port",
        "0",
        "--max-worker-port",
        "0",
    ]
    log = open(tmp_path / "head.log", "w")
    head = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{ports[1]}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"{address}/api/version", timeout=2)
                break
            except urllib.error.HTTPError:  # up, and refusing us without the token
                break
            except OSError:
                if time.time() > deadline or head.poll() is not None:
                    tail = (tmp_path / "head.log").read_text()[-2000:]
                    raise RuntimeError(f"ray head did not start: {tail}") from None
                time.sleep(1)
        yield address, f"127.0.0.1:{ports[0]}", env
    finally:
        for pid in session_pids(head.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        head.wait(timeout=30)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_job_submit_runs_the_study(ray_head, digits_dir, tmp_path):
    address, gcs_address, env = ray_head
    storage = tmp_path / "storage"
    work = tmp_path / "work"
    work.mkdir()
    study = study_dict(
        digits_dir, storage, name="submitted", training={"max_train_steps": 200, "eval_every_steps": 50}
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
    deadline = time.time() + 480
    while time.time() < deadline:
        state = job_state(address, job_id, env)
        if state in ("SUCCEEDED", "FAILED", "STOPPED"):
            break
        if not seen_live:
            st = subprocess.run(
                [sys.executable, "-m", "service", "status", "submitted", "--storage", str(storage)],
                env=status_env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            seen_live = st.returncode == 0 and "study submitted: running" in st.stdout
        time.sleep(2)
    logs = subprocess.run(
        [f"{BIN}/ray", "job", "logs", "--address", address, job_id],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert state == "SUCCEEDED", logs[-4000:]
    assert seen_live, "playbook status never reached the running coordinator"
    assert "best trial: explore-000" in logs

    rows = pq.read_table(str(storage / "submitted" / "trials.parquet")).to_pylist()
    assert sorted(r["trial_name"] for r in rows) == ["explore-0000", "explore-0001"]
    assert all(r["status"] == "FINISHED" and r["step"] == 200 for r in rows)

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


def job_state(address: str, job_id: str, env: dict) -> str:
    """SUCCEEDED / FAILED / STOPPED once the job ended, else what `ray job status` says."""
    out = subprocess.run(
        [f"{BIN}/ray", "job", "status", "--address", address, job_id],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    text = out.stdout + out.stderr
    for word, state in (("succeeded", "SUCCEEDED"), ("failed", "FAILED"), ("was stopped", "STOPPED")):
        if f"Job '{job_id}' {word}" in text:
            return state
    return "RUNNING"
