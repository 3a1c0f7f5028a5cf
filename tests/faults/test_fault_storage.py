"""Storage faults: transient write errors are retried with backoff and then succeed; errors that
persist, and permission errors (not retried), end in one StorageError line and leave the
previous content intact. The filesystem is a real fsspec memory filesystem that fails on purpose
(raising what gcsfs raises too), and a real gcp-storage-emulator that goes away mid-write."""

from __future__ import annotations

import errno
import os
import threading
import time

import fsspec
import pytest

from service.core import storage
from service.core.errors import StorageError
from tests.helpers.flaky_storage import FlakyMemoryFS, unwritable_dir


@pytest.fixture
def flaky():
    fsspec.register_implementation("flaky", FlakyMemoryFS, clobber=True)
    FlakyMemoryFS.store.clear()
    FlakyMemoryFS.write_attempts.clear()
    yield FlakyMemoryFS
    FlakyMemoryFS.fail_writes = 0
    FlakyMemoryFS.error = ConnectionResetError(errno.ECONNRESET, "connection reset by peer")
    FlakyMemoryFS.store.clear()


def test_transient_write_errors_are_retried_with_backoff(flaky):
    uri = "flaky://bucket/study/trials.csv"
    flaky.fail_writes = 3
    storage.write_bytes_atomic(uri, b"rows")
    assert storage.read_bytes(uri) == b"rows"
    attempts = flaky.write_attempts
    assert len(attempts) == 4  # three failures, then the write that worked
    gaps = [b - a for a, b in zip(attempts, attempts[1:], strict=False)]
    for i, gap in enumerate(gaps):  # sleep never returns early: lower bounds only
        assert gap >= 0.05 * 2**i


def test_persistent_errors_fail_in_one_line_and_keep_the_old_content(flaky):
    uri = "flaky://bucket/study/trials.csv"
    storage.write_bytes_atomic(uri, b"old rows")
    flaky.fail_writes = 100
    with pytest.raises(StorageError) as e:
        storage.write_bytes_atomic(uri, b"new rows")
    assert str(e.value).startswith(f"{uri}: cannot write (") and "\n" not in str(e.value)
    assert len(flaky.write_attempts) == 1 + 5  # the first write, then five tries
    flaky.fail_writes = 0
    assert storage.read_bytes(uri) == b"old rows"


def test_permission_errors_are_not_retried(flaky):
    uri = "flaky://bucket/study/study.yaml"
    flaky.fail_writes, flaky.error = 100, PermissionError(errno.EACCES, "permission denied")
    with pytest.raises(StorageError, match="permission denied"):
        storage.write_bytes_atomic(uri, b"x")
    assert len(flaky.write_attempts) == 1
    assert not storage.exists(uri)


def test_a_local_write_that_fails_leaves_no_partial_file(tmp_path):
    target = tmp_path / "study"
    target.mkdir()
    (target / "trials.csv").write_bytes(b"old")
    with pytest.raises(StorageError):  # a directory where the file should go: not retried
        storage.write_bytes_atomic(str(target / "trials.csv" / "x"), b"new")
    assert sorted(os.listdir(target)) == ["trials.csv"]
    assert (target / "trials.csv").read_bytes() == b"old"


def test_permission_denied_storage_is_one_clear_line(tmp_path):
    base = unwritable_dir(tmp_path)
    uri = f"{base}/study/trials.csv"
    with pytest.raises(StorageError) as e:
        storage.write_bytes_atomic(uri, b"x")
    assert str(e.value).startswith(f"{uri}: cannot write (") and "\n" not in str(e.value)
    assert not os.path.exists(f"{base}/study")


def gcsfs_errors():
    from gcsfs.retry import HttpError

    forbidden = OSError("Forbidden: playbook-test/study/study.yaml\nanon caller has no access")
    unavailable = HttpError({"code": 503, "message": "backend unavailable"})
    bad_request = HttpError({"code": 400, "message": "bad object name"})
    return forbidden, unavailable, bad_request


def test_gcsfs_forbidden_is_permanent_and_one_line(flaky):
    forbidden, _, _ = gcsfs_errors()
    uri = "flaky://bucket/study/study.yaml"
    flaky.fail_writes, flaky.error = 100, forbidden
    with pytest.raises(StorageError) as e:
        storage.write_bytes_atomic(uri, b"x")
    assert len(flaky.write_attempts) == 1  # a 403 is not retried
    assert "\n" not in str(e.value) and "Forbidden" in str(e.value) and "no access" in str(e.value)


def test_gcsfs_http_errors_are_storage_errors_retried_when_transient(flaky):
    _, unavailable, bad_request = gcsfs_errors()
    uri = "flaky://bucket/study/trials.csv"
    flaky.fail_writes, flaky.error = 2, unavailable  # a 503 twice, then it works
    storage.write_bytes_atomic(uri, b"rows")
    assert storage.read_bytes(uri) == b"rows" and len(flaky.write_attempts) == 3

    flaky.write_attempts.clear()
    flaky.fail_writes, flaky.error = 100, bad_request  # not an OSError, and not transient
    with pytest.raises(StorageError, match="bad object name"):
        storage.write_bytes_atomic(uri, b"new rows")
    assert len(flaky.write_attempts) == 1
    flaky.fail_writes = 0
    assert storage.read_bytes(uri) == b"rows"


def test_a_write_while_the_gcs_emulator_is_down_completes_when_it_is_back(tmp_path, monkeypatch):
    """The emulator process ends (connections refused) and a new one comes up on the same port
    3 s later; a write issued in between is retried until it lands, whole."""
    from tests.helpers.gcs import start_emulator, stop_emulator

    log = str(tmp_path / "emulator.log")
    proc, endpoint = start_emulator(log, default_bucket="flaky-bucket")
    port = int(endpoint.rsplit(":", 1)[1])
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", endpoint)
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    uri = "gs://flaky-bucket/study/trials.csv"
    data = os.urandom(300_000)
    storage.write_bytes_atomic(uri, b"before")
    stop_emulator(proc)

    outcome = {}

    def write():
        t = time.monotonic()
        try:
            storage.write_bytes_atomic(uri, data)
            outcome["s"] = time.monotonic() - t
        except BaseException as e:  # noqa: BLE001 - reported below
            outcome["error"] = e

    writer = threading.Thread(target=write)
    writer.start()
    time.sleep(3)
    proc, _ = start_emulator(log, default_bucket="flaky-bucket", port=port)
    try:
        writer.join(timeout=120)
        assert not writer.is_alive() and "error" not in outcome, outcome
        assert outcome["s"] >= 3  # it waited for storage, it did not give up
        assert storage.read_bytes(uri) == data
    finally:
        stop_emulator(proc)
