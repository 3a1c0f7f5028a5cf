"""A token-auth `ray start --head` started by a test, and `ray job` state and logs polled."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from tests.helpers.processes import free_ports, session_pids

BIN = os.path.dirname(sys.executable)


@contextlib.contextmanager
def start_ray_head(tmp_path, extra_env: dict[str, str] | None = None):
    """A token-auth Ray head in its own session, its processes started with `extra_env`; yields
    (dashboard address, GCS address, the env of a client holding the token). All of its
    processes are killed afterwards."""
    ports = free_ports(12)
    token = secrets.token_hex(16)
    temp_dir = f"/tmp/rh-{secrets.token_hex(3)}"  # short: Ray's socket paths have a length limit
    env = {
        **os.environ,
        **(extra_env or {}),
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


def wait_for_job(address: str, job_id: str, env: dict, timeout_s: float) -> tuple[str, str]:
    """(final state, logs) of a submitted job, polling until it ends or `timeout_s` passes."""
    deadline = time.time() + timeout_s
    state = job_state(address, job_id, env)
    while state == "RUNNING" and time.time() < deadline:
        time.sleep(2)
        state = job_state(address, job_id, env)
    return state, job_logs(address, job_id, env)


def job_logs(address: str, job_id: str, env: dict) -> str:
    return subprocess.run(
        [f"{BIN}/ray", "job", "logs", "--address", address, job_id],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
