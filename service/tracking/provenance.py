"""Where a study came from: the service's version, the workload module's file and the state of
the git repository holding it (commit, and the uncommitted diff saved beside the study when
the tree is dirty), the import path, and the command that reproduces the study.

The playbook: "experiments that aren't tracked might as well not exist". The reproduction
command is an argument list (run without a shell) that reruns the stored, resolved study file
with the same import path; with the commit checked out and the diff applied, it plans the same
trials again. Against the same storage it resumes the stored study (finished trials are kept);
`--storage ELSEWHERE` trains it again from scratch.

The diff is readable by everyone who can read the study, so it holds text files only: binary
files, files that look like secrets (`SECRET_PATTERNS`) and whatever exceeds `DIFF_CAP_BYTES`
are left out, each named with the reason in the record (`diff_left_out`).
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.metadata
import os
import re
import shutil
import sys
import tempfile

import service
from service.core import storage
from service.core.git import git
from service.study.layout import StudyLayout

DIFF_CAP_BYTES = 1 << 20
SECRET_PATTERNS = (
    ".env",
    ".env.*",
    "*.env",
    "*.pem",
    "*key*",
    "id_rsa*",
    "id_dsa*",
    "id_ecdsa*",
    "id_ed25519*",
    "*credential*",
    "*secret*",
    "*password*",
    ".netrc",
    ".pgpass",
    ".pypirc",
    ".npmrc",
    ".htpasswd",
    "*.p12",
    "*.pfx",
    "*.jks",
    "*.keystore",
    "*.kdbx",
)
"""File names (matched case-insensitively) never copied into a study's diff."""


def _text(out: bytes | None) -> str | None:
    return (out or b"").decode().strip() or None


def repository(path: str) -> str | None:
    """The top folder of the git working tree that holds `path` (a file or folder), or None
    when it is in none, or only in an ignored part of one (a virtualenv inside a project)."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    top = _text(git(folder, "rev-parse", "--show-toplevel"))
    if top is None or git(folder, "check-ignore", "-q", path) is not None:
        return None
    return top


def looks_secret(path: str) -> bool:
    name = os.path.basename(path).lower()
    return any(fnmatch.fnmatchcase(name, p) for p in SECRET_PATTERNS)


def uncommitted_diff(top: str, cap: int = DIFF_CAP_BYTES) -> tuple[bytes, list[dict]]:
    """Every text change of the working tree at `top` against HEAD, new files not yet added to
    git included (`git diff HEAD` alone misses them: a new workload module would look like a
    clean tree), and the files left out, each with its reason. New files are listed in a
    throwaway copy of the index (intent-to-add: their contents are not copied into git), so the
    user's own index and object store are left as they were."""
    git_dir = _text(git(top, "rev-parse", "--absolute-git-dir")) or ""
    with tempfile.TemporaryDirectory(prefix="playbook-git-") as tmp:
        index = os.path.join(tmp, "index")
        if os.path.exists(os.path.join(git_dir, "index")):
            shutil.copyfile(os.path.join(git_dir, "index"), index)
        env = {**os.environ, "GIT_INDEX_FILE": index}
        if git(top, "add", "--intent-to-add", "--all", ".", env=env) is None:
            env = None  # the tracked files' changes, at least
        diff = ("--literal-pathspecs", "diff", "HEAD", "--no-renames", "--no-color", "--no-ext-diff")
        stat = git(top, *diff, "--numstat", "-z", env=env) or b""
        changed = [entry.split(b"\t", 2) for entry in stat.split(b"\0") if entry]
        left_out, kept = [], []
        for added, _, path in changed:
            path = path.decode(errors="replace")
            reason = "binary" if added == b"-" else "looks like a secret" if looks_secret(path) else None
            if reason:
                left_out.append({"path": path, "reason": reason})
            else:
                kept.append(path)
        patch = git(top, *diff, "--", *kept, env=env) if kept else b""
    return _capped(patch or b"", kept, cap, left_out)


def _capped(patch: bytes, paths: list[str], cap: int, left_out: list[dict]) -> tuple[bytes, list[dict]]:
    """The patch's per-file parts (in `paths` order) while their total stays within `cap`."""
    parts = [p for p in re.split(rb"(?m)^(?=diff --git )", patch) if p]
    if len(parts) != len(paths):  # not one part per file: keep nothing rather than guess
        return b"", left_out + [{"path": p, "reason": "diff could not be split by file"} for p in paths]
    out, size = [], 0
    for path, part in zip(paths, parts, strict=True):
        if size + len(part) > cap:
            left_out.append({"path": path, "reason": f"over the diff size cap ({cap} bytes)"})
            continue
        out.append(part)
        size += len(part)
    return b"".join(out), left_out


def repository_state(path: str | None, cap: int = DIFF_CAP_BYTES) -> dict:
    """The git state of the working tree holding `path`: its top folder, commit, and the
    uncommitted text changes (see `uncommitted_diff`)."""
    top = repository(path) if path else None
    commit = _text(git(top, "rev-parse", "HEAD")) if top else None
    diff, left_out = uncommitted_diff(top, cap) if commit else (b"", [])
    return {"repository": top, "commit": commit, "diff": diff, "left_out": left_out}


def service_version() -> dict:
    """The service's package version and, when it runs from a git checkout, its commit."""
    try:
        version = importlib.metadata.version("playbook-service")
    except importlib.metadata.PackageNotFoundError:
        version = service.__version__
    package = os.path.dirname(os.path.abspath(service.__file__))
    top = repository(package)
    commit = _text(git(top, "rev-parse", "HEAD")) if top else None
    dirty = bool(git(top, "status", "--porcelain", "--", package)) if commit else None
    return {"version": version, "git_commit": commit, "git_dirty": dirty}


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def reproduce_command(study_uri: str, workload: str, import_path: list[str]) -> list[str]:
    """`python -m service run <stored study.yaml>`; for a workload of one's own, under `env`
    with the PYTHONPATH that imports it as this run did (its import path, then PYTHONPATH)."""
    from service.workloads import BUILTIN

    command = [sys.executable, "-m", "service", "run", StudyLayout(study_uri).study_file]
    if workload in BUILTIN:
        return command
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return ["env", "PYTHONPATH=" + os.pathsep.join(dict.fromkeys([*import_path, *inherited])), *command]


def capture(study_uri: str, workload: str, import_path: list[str], cap: int = DIFF_CAP_BYTES) -> dict:
    """Record provenance for the study at `study_uri` whose workload is `workload` (imported
    with `import_path` first); returns what was saved."""
    from service.workloads import source_file

    module_file = source_file(workload)
    state = repository_state(module_file, cap)
    record = {
        "service": service_version(),
        "workload": {
            "name": workload,
            "file": module_file,
            "sha256": sha256(module_file) if module_file else None,
        },
        "git_repository": state["repository"],
        "git_commit": state["commit"],
        "git_dirty": bool(state["diff"] or state["left_out"]),
        "uncommitted_diff": StudyLayout(study_uri).uncommitted_diff if state["diff"] else None,
        "diff_left_out": state["left_out"],
        "import_path": import_path,
        "reproduce": reproduce_command(study_uri, workload, import_path),
    }
    if state["diff"]:
        storage.write_bytes_atomic(record["uncommitted_diff"], state["diff"])
    storage.write_json(StudyLayout(study_uri).provenance, record)
    return record


def summary(record: dict) -> str:
    """One line for the job log: the service version, the workload's file and its repository."""
    svc = record["service"]
    line = f"provenance: service {svc['version']}"
    if svc["git_commit"]:
        line += f" (commit {svc['git_commit'][:12]}{', dirty' if svc['git_dirty'] else ''})"
    line += f"; workload {record['workload']['name']} from {record['workload']['file']}"
    if not record["git_commit"]:
        return line + " (not in a git repository)"
    line += f"; {record['git_repository']} at commit {record['git_commit'][:12]}"
    if record["uncommitted_diff"]:
        line += f" (dirty; diff saved to {record['uncommitted_diff']})"
    left_out = record["diff_left_out"]
    if left_out:
        named = ", ".join(f"{f['path']} ({f['reason']})" for f in left_out[:5])
        line += f"; left out of the diff: {named}" + (
            f" and {len(left_out) - 5} more" if len(left_out) > 5 else ""
        )
    return line


def read(study_uri: str) -> dict | None:
    """The study's provenance record (written by `capture` when it was submitted), if any."""
    uri = StudyLayout(study_uri).provenance
    return storage.read_json(uri)
