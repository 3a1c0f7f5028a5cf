"""Running git: the service records the commit of its own source and of a workload's repository."""

from __future__ import annotations

import subprocess


def git(cwd: str, *args: str, env: dict | None = None) -> bytes | None:
    """`git *args` in `cwd`: its stdout, or None when git fails, is missing or hangs."""
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, timeout=30, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None
