"""Study provenance: the commit plus the saved uncommitted diff rebuild the dirty tree, and the
reproduction command's stored study file plans the same trials as the original."""

from __future__ import annotations

import json
import subprocess

from service import provenance, spec, storage
from service.rounds import plan_round
from tests.conftest import make_study


def git(cwd, *args) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def committed_repo(repo, file_name: str, text: str):
    """A new git repository with one committed file."""
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / file_name).write_text(text)
    git(repo, "add", file_name)
    git(repo, "commit", "-qm", "first")
    return repo


def test_commit_and_saved_diff_rebuild_the_dirty_tree(tmp_path):
    repo = committed_repo(tmp_path / "repo", "model.py", "width = 16\n")
    (repo / "model.py").write_text("width = 32  # an experiment nobody committed\n")

    study_uri = str(tmp_path / "studies" / "s")
    record = provenance.capture(str(repo), study_uri)
    assert record["git_commit"] == git(repo, "rev-parse", "HEAD").strip()
    assert record["git_dirty"]
    with open(storage.join(study_uri, "provenance.json")) as f:
        assert json.load(f) == record

    # A clean checkout of the commit plus the saved diff is the tree the study ran from.
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(repo), str(clone))
    git(clone, "checkout", "-q", record["git_commit"])
    git(clone, "apply", record["uncommitted_diff"])
    assert (clone / "model.py").read_text() == (repo / "model.py").read_text()


def test_clean_tree_and_no_repository(tmp_path):
    repo = committed_repo(tmp_path / "repo", "a.txt", "x\n")
    clean = provenance.capture(str(repo), str(tmp_path / "s1"))
    assert clean["git_commit"] and not clean["git_dirty"] and clean["uncommitted_diff"] is None

    outside = tmp_path / "not-a-repo"
    outside.mkdir()
    none = provenance.capture(str(outside), str(tmp_path / "s2"))
    assert none["git_commit"] is None and not none["git_dirty"]


def test_reproduction_command_replans_the_same_trials(digits_dir, tmp_path):
    study = make_study(digits_dir, tmp_path, rounds=[{"name": "explore", "num_trials": 5}])
    storage.write_bytes_atomic(storage.join(study.study_uri, "study.yaml"), spec.dump_yaml(study).encode())
    record = provenance.capture(str(tmp_path), study.study_uri)
    assert record["reproduce"][1:4] == ["-m", "service", "run"]
    again = spec.load_file(record["reproduce"][-1])
    assert plan_round(again, again.rounds[0], []) == plan_round(study, study.rounds[0], [])
