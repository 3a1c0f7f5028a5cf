"""gs:// for tests: gcp-storage-emulator on loopback, in memory, and the environment that points
the service's gcsfs (service/storage.py) and every process started with it at the emulator."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
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
