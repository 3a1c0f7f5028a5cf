"""A gcp-storage-emulator on a free loopback port, for gs:// tests through gcsfs.

`gcs_emulator` (session fixture, from conftest) starts the emulator in a subprocess, sets the
environment the service reads (STORAGE_EMULATOR_HOST; GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false,
without which gcsfs spends 60 s on a gRPC bucket-type probe), creates a bucket and yields its
gs:// root; at the end it stops the emulator by its pid and restores the environment.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

BUCKET = "playbook-test"
ENV = ("STORAGE_EMULATOR_HOST", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _executable() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "gcp-storage-emulator")
    return here if os.path.exists(here) else shutil.which("gcp-storage-emulator") or here


def start_emulator(log_path: str) -> tuple[subprocess.Popen, str]:
    """Start the emulator (in memory) and wait until it answers; returns (process, endpoint)."""
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = open(log_path, "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [_executable(), "start", "--host=127.0.0.1", f"--port={port}", "--in-memory", "-q"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gcp-storage-emulator exited with {proc.returncode} (see {log_path})")
        try:
            urllib.request.urlopen(f"{endpoint}/storage/v1/b?project=test", timeout=1).read()
            return proc, endpoint
        except OSError:
            time.sleep(0.2)
    stop_emulator(proc)
    raise RuntimeError(f"gcp-storage-emulator did not answer on {endpoint} within 30 s")


def stop_emulator(proc: subprocess.Popen) -> None:
    """Stop the emulator's process group (it was started in its own session) by its pid."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def emulated_bucket(tmp_dir: str) -> Iterator[str]:
    """Generator behind the fixture: yields gs://BUCKET with the environment set."""
    proc, endpoint = start_emulator(os.path.join(tmp_dir, "gcs-emulator.log"))
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ["STORAGE_EMULATOR_HOST"] = endpoint
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
    try:
        from service import storage

        fs, _ = storage.split(f"gs://{BUCKET}")
        fs.mkdir(BUCKET)
        yield f"gs://{BUCKET}"
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        stop_emulator(proc)
