"""Study provenance, on real temporary git repositories: the service's version, the workload
module's file and the state of the repository holding it (never the working directory's), the
saved uncommitted diff (new, unadded files included; binary files, secrets and whatever exceeds
the size cap left out and named) rebuilds the dirty tree, and the reproduction command, run
again from elsewhere, imports the workload and trains the same trials."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess

import pytest
import yaml

import service
from service.core import storage
from service.planning.rounds import plan_round
from service.study import spec
from service.tracking import provenance, trial_table
from tests.helpers import contract_workloads as cw
from tests.helpers.processes import end_session
from tests.helpers.studies import make_study

WORKLOAD_SOURCE = """from service.workloads.digits import Digits


class Mine(Digits):
    name = "mine"
"""


def git(cwd, *args) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def committed_repo(repo, files: dict[str, str]):
    """A new git repository with `files` committed."""
    repo.mkdir(parents=True)
    git(repo, "init", "-q")
    for name, text in files.items():
        (repo / name).write_text(text)
    git(repo, "add", *files)
    git(repo, "commit", "-qm", "first")
    return repo


def own_workload(repo, monkeypatch, committed: bool = True) -> str:
    """A workload module of one's own in `repo` (a name of its own per test: Python caches
    imported modules), importable; returns its `module:Class`."""
    module = f"wl_{hashlib.sha1(str(repo).encode()).hexdigest()[:10]}"
    (repo / f"{module}.py").write_text(WORKLOAD_SOURCE)
    if committed:
        git(repo, "add", f"{module}.py")
        git(repo, "commit", "-qm", "workload")
    monkeypatch.syspath_prepend(str(repo))
    return f"{module}:Mine"


def capture(repo, workload, study_uri, **kw) -> dict:
    return provenance.capture(str(study_uri), workload, [str(repo)], **kw)


def test_commit_and_saved_diff_rebuild_the_dirty_tree(tmp_path, monkeypatch):
    repo = committed_repo(tmp_path / "repo", {"model.py": "width = 16\n"})
    workload = own_workload(repo, monkeypatch)
    (repo / "model.py").write_text("width = 32  # an experiment nobody committed\n")

    study_uri = str(tmp_path / "studies" / "s")
    record = capture(repo, workload, study_uri)
    assert record["git_repository"] == str(repo)
    assert record["git_commit"] == git(repo, "rev-parse", "HEAD").strip()
    assert record["git_dirty"]
    assert record["workload"]["file"] == str(repo / f"{workload.split(':')[0]}.py")
    with open(storage.join(study_uri, "provenance.json")) as f:
        assert json.load(f) == record

    # A clean checkout of the commit plus the saved diff is the tree the study ran from.
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(repo), str(clone))
    git(clone, "checkout", "-q", record["git_commit"])
    git(clone, "apply", record["uncommitted_diff"])
    assert (clone / "model.py").read_text() == (repo / "model.py").read_text()


def test_the_workload_modules_repository_is_recorded_not_the_working_directorys(tmp_path, monkeypatch):
    """Run from inside another, dirty repository (with a binary data file): provenance is the
    workload module's repository; nothing of the other one is stored."""
    repo = committed_repo(tmp_path / "repo", {"model.py": "width = 16\n"})
    workload = own_workload(repo, monkeypatch)
    other = committed_repo(tmp_path / "other", {"notes.txt": "x\n"})
    (other / "notes.txt").write_text("changed\n")
    (other / "shard.parquet").write_bytes(b"PAR1" + bytes(range(256)) * 64)
    monkeypatch.chdir(other)

    record = capture(repo, workload, tmp_path / "s")
    assert record["git_repository"] == str(repo)
    assert record["git_commit"] == git(repo, "rev-parse", "HEAD").strip()
    assert not record["git_dirty"] and record["uncommitted_diff"] is None
    assert not os.path.exists(tmp_path / "s" / "uncommitted.diff")


def test_new_files_are_in_the_diff_binary_and_secret_ones_left_out_and_named(tmp_path, monkeypatch):
    repo = committed_repo(tmp_path / "repo", {"model.py": "width = 16\n", ".env": "A=1\n"})
    workload = own_workload(repo, monkeypatch)
    (repo / "features.py").write_text("def f(x):\n    return x\n")  # never `git add`ed
    (repo / "weights.bin").write_bytes(bytes(range(256)))  # binary, not UTF-8
    secrets = {
        ".env": "A=1\nTOKEN=hunter2\n",  # committed, then changed: its diff would show the value
        ".env.local": "PASSWORD=hunter2\n",
        "id_rsa": "-----BEGIN OPENSSH PRIVATE KEY----- hunter2\n",
        "server.pem": "-----BEGIN CERTIFICATE----- hunter2\n",
        "api_key.txt": "hunter2\n",
        "gcp-credentials.json": '{"private_key": "hunter2"}\n',
        "Secrets.yaml": "db: hunter2\n",
    }
    for name, text in secrets.items():
        (repo / name).write_text(text)
    (repo / ".gitignore").write_text("*.log\n")
    (repo / "run.log").write_text("ignored\n")
    status_before = git(repo, "status", "--porcelain")

    record = capture(repo, workload, tmp_path / "s")
    assert record["git_dirty"]
    assert git(repo, "status", "--porcelain") == status_before  # the user's index as it was
    with open(record["uncommitted_diff"], "rb") as f:
        diff = f.read()
    assert b"hunter2" not in diff
    left_out = {f["path"]: f["reason"] for f in record["diff_left_out"]}
    assert left_out == {"weights.bin": "binary", **{name: "looks like a secret" for name in secrets}}
    line = provenance.summary(record)  # what `playbook run` prints
    assert f"{repo} at commit {record['git_commit'][:12]} (dirty; diff saved to" in line
    assert ".env (looks like a secret)" in line and "and 3 more" in line

    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(repo), str(clone))
    git(clone, "apply", record["uncommitted_diff"])
    assert (clone / "features.py").read_text() == "def f(x):\n    return x\n"
    assert (clone / ".gitignore").read_text() == "*.log\n"
    assert not (clone / "weights.bin").exists() and not (clone / "run.log").exists()
    assert (clone / ".env").read_text() == "A=1\n"  # as committed


def test_the_diff_is_capped_and_what_was_left_out_is_named(tmp_path, monkeypatch):
    repo = committed_repo(tmp_path / "repo", {"a.py": "a = 0\n"})
    workload = own_workload(repo, monkeypatch)
    texts = {
        name: f"# {name}\n" + "x = 1\n" * 100 for name in ("a.py", "b.py", "c.py")
    }  # ~800 B of diff each
    for name, text in texts.items():
        (repo / name).write_text(text)

    record = capture(repo, workload, tmp_path / "s", cap=2000)
    with open(record["uncommitted_diff"], "rb") as f:
        diff = f.read()
    assert 1500 < len(diff) <= 2000  # two parts of about 800 bytes
    assert record["diff_left_out"] == [{"path": "c.py", "reason": "over the diff size cap (2000 bytes)"}]
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(repo), str(clone))
    git(clone, "apply", record["uncommitted_diff"])
    assert [(clone / n).read_text() for n in ("a.py", "b.py")] == [texts["a.py"], texts["b.py"]]
    assert not (clone / "c.py").exists()


def test_clean_tree_no_repository_and_the_service_version(tmp_path, monkeypatch):
    repo = committed_repo(tmp_path / "repo", {"a.txt": "x\n"})
    clean = capture(repo, own_workload(repo, monkeypatch), tmp_path / "s1")
    assert clean["git_commit"] and not clean["git_dirty"] and clean["uncommitted_diff"] is None

    outside = tmp_path / "not-a-repo"
    outside.mkdir()
    workload = own_workload(outside, monkeypatch, committed=False)
    none = capture(outside, workload, tmp_path / "s2")
    assert none["git_commit"] is None and none["git_repository"] is None and not none["git_dirty"]
    module_file = outside / f"{workload.split(':')[0]}.py"
    assert none["workload"] == {
        "name": workload,
        "file": str(module_file),
        "sha256": hashlib.sha256(module_file.read_bytes()).hexdigest(),
    }

    # The service's own version: the installed package's, and its checkout's commit.
    service_dir = os.path.dirname(os.path.abspath(service.__file__))
    assert none["service"]["version"] == importlib.metadata.version("playbook-service")
    assert none["service"]["git_commit"] == git(service_dir, "rev-parse", "HEAD").strip()
    assert none["service"]["git_dirty"] == bool(git(service_dir, "status", "--porcelain", "--", "."))


@pytest.mark.ray
def test_the_reproduction_command_run_again_trains_the_same_trials(tmp_path, monkeypatch):
    """A study on a workload of one's own (the tabular example's module, beside the study
    file): the stored command, executed as it is (no shell) from another folder, imports the
    workload and trains the same trials (`--storage` elsewhere: anew, not a resume)."""
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(os.path.join(cw.STUDY_DIR, "tabular_workload.py"), project / "repro_workload.py")
    cw.write_tabular_data(str(tmp_path / "data"))
    with open(os.path.join(cw.STUDY_DIR, "study.yaml")) as f:
        d = yaml.safe_load(f)
    d.update(
        name="repro",
        workload="repro_workload:TabularMLP",
        data={s: str(tmp_path / "data" / s) for s in ("train", "validation", "test")},
        storage=str(tmp_path / "first"),
        scaling={"num_hosts": 1, "workers_per_host": 1},
        rounds=[{"name": "explore", "num_trials": 3}],
    )
    d["training"].update(max_train_steps=8, eval_every_steps=8, schedule={"kind": "constant"})
    study = spec.load_dict(d)
    storage.write_bytes_atomic(storage.join(study.study_uri, "study.yaml"), spec.dump_yaml(study).encode())
    monkeypatch.syspath_prepend(str(project))
    record = provenance.capture(study.study_uri, study.workload, [str(project)])
    assert record["reproduce"][-1] == storage.join(study.study_uri, "study.yaml")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
    proc = subprocess.Popen(
        [*record["reproduce"], "--storage", str(tmp_path / "again")],
        cwd=elsewhere,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    out = proc.communicate(timeout=600)[0]
    end_session(proc)
    assert proc.returncode == 0, out[-3000:]

    rows = trial_table.read_rows(str(tmp_path / "again" / "repro"))
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
