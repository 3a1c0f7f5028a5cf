"""Where a study came from: the git commit of the working directory, the uncommitted diff
(saved beside the study when the tree is dirty), and the command that reproduces the study.

The playbook: "experiments that aren't tracked might as well not exist". The reproduction
command is an argument list (run without a shell) that reruns the stored, resolved study file;
with the commit checked out and the diff applied, it plans the same trials again. Against the
same storage it resumes the stored study (finished trials are kept); `--storage ELSEWHERE`
trains it again from scratch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

from service import storage

DIFF_FILE = "uncommitted.diff"
RECORD_FILE = "provenance.json"


def _git(cwd: str, *args: str, env: dict | None = None) -> bytes | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, timeout=30, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def uncommitted_diff(cwd: str) -> bytes:
    """Every change against HEAD, new files not yet added to git included (`git diff HEAD`
    alone misses them: a new workload module would look like a clean tree). Staged through a
    throwaway copy of the index, so the user's own index is left as it was. Binary-safe."""
    git_dir = (_git(cwd, "rev-parse", "--absolute-git-dir") or b"").decode().strip()
    with tempfile.TemporaryDirectory(prefix="playbook-git-") as tmp:
        index = os.path.join(tmp, "index")
        if os.path.exists(os.path.join(git_dir, "index")):
            shutil.copyfile(os.path.join(git_dir, "index"), index)
        env = {**os.environ, "GIT_INDEX_FILE": index}
        if _git(cwd, "add", "--all", ".", env=env) is None:
            return _git(cwd, "diff", "HEAD", "--binary") or b""
        return _git(cwd, "diff", "--cached", "HEAD", "--binary", env=env) or b""


def capture(cwd: str, study_uri: str) -> dict:
    """Record provenance for the study at `study_uri` run from `cwd`; returns what was saved."""
    commit = (_git(cwd, "rev-parse", "HEAD") or b"").decode().strip() or None
    diff = uncommitted_diff(cwd) if commit else None
    record = {
        "git_commit": commit,
        "git_dirty": bool(diff),
        "uncommitted_diff": storage.join(study_uri, DIFF_FILE) if diff else None,
        "reproduce": [sys.executable, "-m", "service", "run", storage.join(study_uri, "study.yaml")],
    }
    if diff:
        storage.write_bytes_atomic(record["uncommitted_diff"], diff)
    storage.write_json(storage.join(study_uri, RECORD_FILE), record)
    return record


def read(study_uri: str) -> dict | None:
    """The study's provenance record (written by `capture` when it was submitted), if any."""
    uri = storage.join(study_uri, RECORD_FILE)
    return json.loads(storage.read_bytes(uri)) if storage.exists(uri) else None
