"""gs:// for tests: gcp-storage-emulator on loopback, in memory, and the environment that points
the service's gcsfs (service/storage.py) and every process started with it at the emulator."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator

from tests.conftest import free_ports

BIN = os.path.dirname(sys.executable)


@contextlib.contextmanager
def gcs_emulator(bucket: str, log_path) -> Iterator[dict[str, str]]:
    """An emulator with `bucket` created; yields the env vars that select it."""
    port = free_ports(1)[0]
    log = open(log_path, "w")
    cmd = [f"{BIN}/gcp-storage-emulator", "start", "--host=127.0.0.1", f"--port={port}", "--in-memory"]
    proc = subprocess.Popen(
        [*cmd, f"--default-bucket={bucket}"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/storage/v1/b/{bucket}", timeout=2)
                break
            except (OSError, urllib.error.HTTPError):
                if time.time() > deadline or proc.poll() is not None:
                    tail = open(log_path).read()[-2000:]
                    raise RuntimeError(f"gcs emulator did not start: {tail}") from None
                time.sleep(0.5)
        # Without the last one gcsfs spends ~60 s probing the bucket type over gRPC.
        yield {"STORAGE_EMULATOR_HOST": endpoint, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        log.close()


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
