"""Storage faults: transient write errors are retried with backoff and then succeed; errors that
persist, and permission errors (not retried), end in one StorageError line and leave the
previous content intact. The filesystem is a real fsspec memory filesystem that fails on purpose."""

from __future__ import annotations

import errno
import os
import time

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from service import storage
from service.errors import StorageError


class FlakyMemoryFS(MemoryFileSystem):
    """An in-memory filesystem whose next `fail_writes` opens for writing raise `error`."""

    protocol = "flaky"
    store: dict = {}  # its own files, not the shared memory:// store
    pseudo_dirs = [""]
    fail_writes = 0
    error: OSError = ConnectionResetError(errno.ECONNRESET, "connection reset by peer")
    write_attempts: list[float] = []

    def _open(self, path, mode="rb", **kwargs):
        if "w" in mode:
            FlakyMemoryFS.write_attempts.append(time.monotonic())
            if FlakyMemoryFS.fail_writes > 0:
                FlakyMemoryFS.fail_writes -= 1
                raise FlakyMemoryFS.error
        return super()._open(path, mode, **kwargs)


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


def unwritable_dir(tmp_path) -> str:
    """A directory this process may not create files in: mode 0555, or, for root (whom mode
    bits do not stop), a path in sysfs, which refuses new entries to everyone."""
    if os.geteuid() != 0:
        d = tmp_path / "read-only"
        d.mkdir()
        d.chmod(0o555)
        return str(d)
    return f"/sys/playbook-storage-{os.getpid()}"


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
