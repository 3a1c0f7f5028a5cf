"""Where a study came from: the git commit of the working directory, the uncommitted diff
(saved beside the study when the tree is dirty), and the command that reproduces the study.

The playbook: "experiments that aren't tracked might as well not exist". The reproduction
command is an argument list (run without a shell) that reruns the stored, resolved study file;
with the commit checked out and the diff applied, it plans the same trials again.
"""

from __future__ import annotations

import subprocess
import sys

from service import storage

DIFF_FILE = "uncommitted.diff"


def _git(cwd: str, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def capture(cwd: str, study_uri: str) -> dict:
    """Record provenance for the study at `study_uri` run from `cwd`; returns what was saved."""
    commit = (_git(cwd, "rev-parse", "HEAD") or "").strip() or None
    diff = _git(cwd, "diff", "HEAD", "--binary") if commit else None
    record = {
        "git_commit": commit,
        "git_dirty": bool(diff),
        "uncommitted_diff": storage.join(study_uri, DIFF_FILE) if diff else None,
        "reproduce": [sys.executable, "-m", "service", "run", storage.join(study_uri, "study.yaml")],
    }
    if diff:
        storage.write_bytes_atomic(record["uncommitted_diff"], diff.encode())
    storage.write_json(storage.join(study_uri, "provenance.json"), record)
    return record
