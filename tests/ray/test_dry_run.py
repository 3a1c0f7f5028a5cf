"""`playbook run --dry-run`: every check a run makes before it writes (the study file, the data,
the storage, the cluster), what a run would do, and nothing started or written."""

from __future__ import annotations

import os

import pyarrow.parquet as pq
import pytest
import yaml

from service import cli
from tests.helpers.studies import study_dict

pytestmark = pytest.mark.ray

CLUSTER_CPUS = 2  # the shared cluster's (tests/conftest.py)


def files_under(folder) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)


def write(tmp_path, d: dict) -> str:
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(d))
    return str(path)


def test_a_dry_run_says_what_a_run_would_do_and_writes_nothing(ray_cluster, digits_dir, tmp_path, capsys):
    storage = tmp_path / "storage"
    d = study_dict(digits_dir, str(storage), name="dry")
    d["rounds"] = [{"name": "explore", "num_trials": 3}]
    study_file = write(tmp_path, d)

    assert cli.main(["run", study_file, "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    # One CPU per one-worker trial: the cluster holds as many at once as it has CPUs.
    assert out == [
        "ok: study dry: 1 round(s), 3 trials, 120 training steps, 1 worker(s) per trial",
        f"dry run: storage {storage / 'dry'} takes writes; this cluster holds {CLUSTER_CPUS} of its "
        "trials at once; a run starts it; nothing was started",
    ]
    assert files_under(tmp_path / "storage") == []  # the storage probe is gone too

    d["rounds"] = [{"name": "explore", "num_trials": 1}]
    assert cli.main(["run", write(tmp_path, d)]) == 0  # the study, stored with one trial done
    capsys.readouterr()
    before = {f: os.path.getmtime(storage / f) for f in files_under(storage)}
    d["rounds"].append({"name": "more", "kind": "quasi_random", "num_trials": 2})  # the study grows
    assert cli.main(["run", write(tmp_path, d), "--dry-run"]) == 0
    assert (
        capsys.readouterr()
        .out.splitlines()[-1]
        .endswith("a run resumes it (1 of 3 trials done); nothing was started")
    )
    assert {f: os.path.getmtime(storage / f) for f in files_under(storage)} == before
    (row,) = pq.read_table(storage / "dry" / "trials.parquet").to_pylist()
    assert row["trial_name"] == "explore-0000" and row["status"] == "FINISHED"


def test_a_dry_run_refuses_what_a_run_refuses(ray_cluster, digits_dir, tmp_path, capsys):
    """A layout the cluster cannot hold, a changed stored study: one line, exit 2, and the
    storage as it was."""
    d = study_dict(digits_dir, str(tmp_path / "storage"), name="too-wide")
    d["scaling"] = {"num_hosts": 1, "workers_per_host": 2 * CLUSTER_CPUS}  # one CPU each
    assert cli.main(["run", write(tmp_path, d), "--dry-run"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("playbook: error: scaling"), line
    assert files_under(tmp_path) == ["study.yaml"]
