"""A gcp-storage-emulator on a free loopback port, for gs:// tests through gcsfs.

`gcs_emulator` (session fixture, from conftest) starts the emulator in a subprocess, sets the
environment the service reads (STORAGE_EMULATOR_HOST; GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false,
without which gcsfs spends 60 s on a gRPC bucket-type probe), creates a bucket and yields its
gs:// root; at the end it stops the emulator by its pid and restores the environment.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator

BUCKET = "playbook-test"
ENV = ("STORAGE_EMULATOR_HOST", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LISTEN_BACKLOG = 128
"""The emulator serves one connection at a time (http.server.HTTPServer) from a listen queue of
5: gcsfs' concurrent GETs (a batched `cat`) from two processes overflow it, and each connection
left out waits for TCP's 1 s retransmission. Real GCS has no such queue; the emulator gets a
longer one."""

_LAUNCH = (
    "import sys, http.server; http.server.HTTPServer.request_queue_size = int(sys.argv.pop(1)); "
    "sys.argv[0] = 'gcp-storage-emulator'; from gcp_storage_emulator.__main__ import main; sys.exit(main())"
)


def emulator_command(*args: str) -> list[str]:
    """The command line of `gcp-storage-emulator ARGS`, with a listen queue of LISTEN_BACKLOG."""
    return [sys.executable, "-c", _LAUNCH, str(LISTEN_BACKLOG), *args]


def start_emulator(
    log_path: str, default_bucket: str | None = None, port: int | None = None
) -> tuple[subprocess.Popen, str]:
    """Start the emulator (in memory, with `default_bucket` created if given; on `port`, else a
    free one) and wait until it answers; returns (process, endpoint)."""
    port = port or _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = open(log_path, "ab")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        emulator_command(
            "start",
            "--host=127.0.0.1",
            f"--port={port}",
            "--in-memory",
            "-q",
            *([f"--default-bucket={default_bucket}"] if default_bucket else []),
        ),  # fmt: skip
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
        from service.core import storage

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


@contextlib.contextmanager
def emulator_env(bucket: str, log_path) -> Iterator[dict[str, str]]:
    """An emulator with `bucket` created, for processes started with the yielded environment
    (this process's own environment is left alone)."""
    proc, endpoint = start_emulator(str(log_path), default_bucket=bucket)
    try:
        yield {"STORAGE_EMULATOR_HOST": endpoint, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    finally:
        stop_emulator(proc)


def read_object(endpoint: str, uri: str) -> bytes:
    """The bytes of gs://bucket/name, through the storage JSON API (no gcsfs: independent of the
    service's filesystem, and no gcsfs import-time settings in this process)."""
    bucket, name = uri.removeprefix("gs://").split("/", 1)
    url = f"{endpoint}/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}?alt=media"
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.read()


def list_objects(endpoint: str, uri: str) -> list[str]:
    """gs:// URIs of every object under the prefix `uri`."""
    bucket, prefix = uri.removeprefix("gs://").split("/", 1)
    names, token = [], ""
    while True:
        query = urllib.parse.urlencode({"prefix": prefix, **({"pageToken": token} if token else {})})
        with urllib.request.urlopen(f"{endpoint}/storage/v1/b/{bucket}/o?{query}", timeout=60) as r:
            page = json.load(r)
        names += [f"gs://{bucket}/{item['name']}" for item in page.get("items", [])]
        token = page.get("nextPageToken")
        if not token:
            return names
