"""`ray job submit -- playbook run study.yaml` against a `ray start --head` with token auth,
started by the test with its own temp dir and ports: the job succeeds and the trial rows exist."""

from __future__ import annotations

import os
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
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,
           "PATH": f"{BIN}:{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    cmd = [f"{BIN}/ray", "start", "--head", "--block", "--disable-usage-stats",
           "--num-cpus", "2", "--include-dashboard=true", "--temp-dir", temp_dir,
           "--port", str(ports[0]), "--dashboard-port", str(ports[1]),
           "--dashboard-agent-listen-port", str(ports[2]),
           "--dashboard-agent-grpc-port", str(ports[3]),
           "--runtime-env-agent-port", str(ports[4]), "--metrics-export-port", str(ports[5]),
           "--ray-client-server-port", str(ports[6]), "--node-manager-port", str(ports[7]),
           "--object-manager-port", str(ports[8]),
           "--min-worker-port", "0", "--max-worker-port", "0"]
    log = open(tmp_path / "head.log", "w")
    head = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
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
                    raise RuntimeError(f"ray head did not start: {(tmp_path / 'head.log').read_text()[-2000:]}")
                time.sleep(1)
        yield address, env
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
    address, env = ray_head
    storage = tmp_path / "storage"
    work = tmp_path / "work"
    work.mkdir()
    study = study_dict(digits_dir, storage, name="submitted")
    (work / "study.yaml").write_text(yaml.safe_dump(study))

    submit = [f"{BIN}/ray", "job", "submit", "--address", address, "--working-dir", str(work),
              "--", "playbook", "run", "study.yaml"]
    out = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=480)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "succeeded" in out.stdout + out.stderr

    rows = pq.read_table(str(storage / "submitted" / "trials.parquet")).to_pylist()
    assert sorted(r["trial_name"] for r in rows) == ["explore-0000", "explore-0001"]
    assert all(r["status"] == "FINISHED" for r in rows)

    # Token auth is really on: a client with the wrong token is refused.
    wrong = {**env, "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    refused = subprocess.run([f"{BIN}/ray", "job", "list", "--address", address], env=wrong,
                             capture_output=True, text=True, timeout=120)
    assert "Invalid authentication token" in refused.stdout + refused.stderr
