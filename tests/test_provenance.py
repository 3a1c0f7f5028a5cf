"""Study provenance: the commit plus the saved uncommitted diff (new, unadded files included)
rebuild the dirty tree, and the reproduction command, run again, trains the same trials."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from service import provenance, spec, storage, tracking
from service.rounds import plan_round
from tests.conftest import end_session, make_study


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


def test_a_new_file_not_added_to_git_is_in_the_diff_and_the_index_is_untouched(tmp_path):
    repo = committed_repo(tmp_path / "repo", "model.py", "width = 16\n")
    (repo / "my_workload.py").write_text("class Mine: ...\n")  # never `git add`ed
    (repo / "weights.bin").write_bytes(bytes(range(256)))  # binary, not UTF-8
    (repo / ".gitignore").write_text("*.log\n")
    (repo / "run.log").write_text("ignored\n")
    status_before = git(repo, "status", "--porcelain")

    record = provenance.capture(str(repo), str(tmp_path / "s"))
    assert record["git_dirty"]
    assert git(repo, "status", "--porcelain") == status_before  # the user's index as it was

    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(repo), str(clone))
    git(clone, "apply", record["uncommitted_diff"])
    assert (clone / "my_workload.py").read_text() == "class Mine: ...\n"
    assert (clone / "weights.bin").read_bytes() == bytes(range(256))
    assert not (clone / "run.log").exists()  # ignored files are not provenance


def test_clean_tree_and_no_repository(tmp_path):
    repo = committed_repo(tmp_path / "repo", "a.txt", "x\n")
    clean = provenance.capture(str(repo), str(tmp_path / "s1"))
    assert clean["git_commit"] and not clean["git_dirty"] and clean["uncommitted_diff"] is None

    outside = tmp_path / "not-a-repo"
    outside.mkdir()
    none = provenance.capture(str(outside), str(tmp_path / "s2"))
    assert none["git_commit"] is None and not none["git_dirty"]


@pytest.mark.ray
def test_the_reproduction_command_run_again_trains_the_same_trials(digits_dir, tmp_path):
    """The stored command, executed as it is (no shell), with --storage pointing elsewhere so
    that it trains anew instead of resuming the stored study."""
    study = make_study(
        digits_dir,
        tmp_path / "first",
        name="repro",
        training={"max_train_steps": 10, "eval_every_steps": 10, "schedule": {"kind": "constant"}},
        rounds=[{"name": "explore", "num_trials": 3}],
    )
    storage.write_bytes_atomic(storage.join(study.study_uri, "study.yaml"), spec.dump_yaml(study).encode())
    record = provenance.capture(os.getcwd(), study.study_uri)
    assert record["reproduce"][-1] == storage.join(study.study_uri, "study.yaml")

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own embedded Ray
    proc = subprocess.Popen(
        [*record["reproduce"], "--storage", str(tmp_path / "again")],
        env={**env, "PYTHONPATH": os.getcwd()},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    out = proc.communicate(timeout=600)[0]
    end_session(proc)
    assert proc.returncode == 0, out[-3000:]

    rows = tracking.read_rows(str(tmp_path / "again" / "repro"))
    got = {
        r["trial_name"]: {k[3:]: v for k, v in r.items() if k.startswith("hp/") and v is not None}
        for r in rows
    }
    want = {c["trial_name"]: c["hparams"] for c in plan_round(study, study.rounds[0], [])}
    assert got == want
    assert {r["status"] for r in rows} == {"FINISHED"}


def test_a_stored_study_file_on_object_storage_loads(digits_dir, tmp_path):
    """The reproduction command names the study file on the study's storage, which may be
    gs:// (here fsspec's memory://, the same code path): it must load from there."""
    study = make_study(digits_dir, tmp_path, rounds=[{"name": "explore", "num_trials": 5}])
    uri = "memory://provenance-test/s/study.yaml"
    storage.write_bytes_atomic(uri, spec.dump_yaml(study).encode())
    again = spec.load_file(uri)
    assert plan_round(again, again.rounds[0], []) == plan_round(study, study.rounds[0], [])
