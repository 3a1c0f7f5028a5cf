"""A token-auth `ray start --head` started by a test, and `ray job` state and logs polled."""

from __future__ import annotations

import contextlib
import json
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


def token_env(token: str, extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a Ray process or client of a token-auth cluster: this one's, with
    `extra_env`, the token and the venv's bin first on PATH (jobs find `playbook` there)."""
    env = {
        **os.environ,
        **(extra_env or {}),
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": token,
        "PATH": f"{BIN}:{os.environ['PATH']}",
    }
    env.pop("RAY_ADDRESS", None)
    return env


def node_port_flags(ports: list[int]) -> list[str]:
    """`ray start` flags giving a node (head or not) ports of its own, from 6 free ports;
    worker processes take any free port. Without them a second Ray on one machine collides
    (its job agent never registers: "No available agent to submit job")."""
    names = (
        "--dashboard-agent-listen-port",
        "--dashboard-agent-grpc-port",
        "--runtime-env-agent-port",
        "--metrics-export-port",
        "--node-manager-port",
        "--object-manager-port",
    )
    flags = [x for name, port in zip(names, ports, strict=True) for x in (name, str(port))]
    return flags + ["--min-worker-port", "0", "--max-worker-port", "0"]


HEAD_PORTS = 9
"""Ports a head needs: GCS, dashboard, Ray client server and the node's own."""


def head_command(temp_dir: str, ports: list[int], num_cpus: int = 2) -> list[str]:
    """`ray start --head --block` with the dashboard on, its own temp dir and `HEAD_PORTS` ports
    (GCS `ports[0]`, dashboard `ports[1]`)."""
    return [
        f"{BIN}/ray",
        "start",
        "--head",
        "--block",
        "--disable-usage-stats",
        "--num-cpus",
        str(num_cpus),
        "--include-dashboard=true",
        "--temp-dir",
        temp_dir,
        "--port",
        str(ports[0]),
        "--dashboard-port",
        str(ports[1]),
        "--ray-client-server-port",
        str(ports[2]),
        *node_port_flags(ports[3:HEAD_PORTS]),
    ]


def wait_for_dashboard(address: str, proc: subprocess.Popen, log_path, timeout_s: float = 120) -> None:
    """Return once the dashboard at `address` answers (refusing a client without the token
    counts); raise with the head log's tail if `proc` ends or `timeout_s` passes first."""
    deadline = time.time() + timeout_s
    while True:
        try:
            urllib.request.urlopen(f"{address}/api/version", timeout=2)
            return
        except urllib.error.HTTPError:  # up, and refusing us without the token
            return
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                tail = open(log_path).read()[-2000:]
                raise RuntimeError(f"ray head did not start: {tail}") from None
            time.sleep(0.2)


def new_temp_dir() -> str:
    """A Ray temp dir of its own, short: Ray's socket paths have a length limit."""
    return f"/tmp/rh-{secrets.token_hex(3)}"


@contextlib.contextmanager
def start_ray_head(tmp_path, extra_env: dict[str, str] | None = None, temp_dir: str | None = None):
    """A token-auth Ray head in its own session, its processes started with `extra_env` and its
    files in `temp_dir` (default: a new short one); yields (dashboard address, GCS address, the
    env of a client holding the token). All of its processes are killed afterwards."""
    ports = free_ports(HEAD_PORTS)
    env = token_env(secrets.token_hex(16), extra_env)
    temp_dir = temp_dir or new_temp_dir()
    log = open(tmp_path / "head.log", "w")
    head = subprocess.Popen(
        head_command(temp_dir, ports), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    address = f"http://127.0.0.1:{ports[1]}"
    try:
        wait_for_dashboard(address, head, tmp_path / "head.log")
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
    """SUCCEEDED / FAILED / STOPPED once the job ended, else RUNNING (also while the dashboard
    does not answer), from the dashboard's job API with the client's token: no `ray job status`
    process per poll, whose start costs seconds of CPU that the job's own trials share."""
    token = env.get("RAY_AUTH_TOKEN")
    request = urllib.request.Request(
        f"{address}/api/jobs/{job_id}", headers={"Authorization": f"Bearer {token}"} if token else {}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            status = json.load(r).get("status")
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):  # the token is wrong: no later poll will answer
            raise
        return "RUNNING"
    except (OSError, ValueError):
        return "RUNNING"
    return status if status in ("SUCCEEDED", "FAILED", "STOPPED") else "RUNNING"


def wait_for_job(address: str, job_id: str, env: dict, timeout_s: float) -> tuple[str, str]:
    """(final state, logs) of a submitted job, polling until it ends or `timeout_s` passes."""
    deadline = time.time() + timeout_s
    state = job_state(address, job_id, env)
    while state == "RUNNING" and time.time() < deadline:
        time.sleep(0.5)
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
