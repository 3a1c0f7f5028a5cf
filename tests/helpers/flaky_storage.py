"""Storage that fails on purpose: an fsspec memory filesystem with scripted errors, a read-only dir."""

from __future__ import annotations

import errno
import os
import time

from fsspec.implementations.memory import MemoryFileSystem


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


def unwritable_dir(tmp_path) -> str:
    """A directory this process may not create files in: mode 0555, or, for root (whom mode
    bits do not stop), a path in sysfs, which refuses new entries to everyone."""
    if os.geteuid() != 0:
        d = tmp_path / "read-only"
        d.mkdir()
        d.chmod(0o555)
        return str(d)
    return f"/sys/playbook-storage-{os.getpid()}"
