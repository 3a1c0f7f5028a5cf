"""A user's own study, end to end, from the user's side: the example of studies/tabular (a
workload module of one's own beside the study file, not a built-in; data written by hand; two
rounds) copied to a folder outside the repository and run by the `playbook` CLI from there,
on a Ray head of exactly 2 CPUs for its 2 workers x 1 CPU: validate --data, run, status, report
and eval of the best checkpoint that run reported; and the same study submitted as a Ray job
(`ray job submit --working-dir`), its study file in a subfolder of the working directory. Both
on one head, started once for the module."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from service.cli.prepare import TRAIN_POLL_ENV
from service.distributed import checkpoint
from tests.helpers import contract_workloads as cw
from tests.helpers.processes import EnvironWatcher
from tests.helpers.ray_head import BIN, start_ray_head, wait_for_job

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A token-auth Ray head of 2 CPUs, started from a folder of its own (its workers' directory
    is not the user's): (dashboard address, GCS address, a client's env without PYTHONPATH)."""
    root = tmp_path_factory.mktemp("head")
    cwd = os.getcwd()
    os.chdir(root)
    # As on a user's machine: Ray Train's poll interval is whatever the service sets (the
    # tests' conftest sets one for every Ray process they start).
    poll = os.environ.pop(TRAIN_POLL_ENV, None)
    try:
        with start_ray_head(root) as (address, gcs_address, env):
            os.chdir(cwd)
            yield address, gcs_address, {k: v for k, v in env.items() if k != "PYTHONPATH"}
    finally:
        os.chdir(cwd)
        if poll is not None:
            os.environ[TRAIN_POLL_ENV] = poll


def playbook(user, env, *args, timeout=600) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [f"{BIN}/playbook", *args], cwd=user, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, f"playbook {' '.join(args)}: {out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def test_a_study_on_a_workload_of_ones_own_from_validate_to_eval(head, tmp_path):
    user = tmp_path / "user"  # the user's working directory; the study in a folder of its own
    shutil.copytree(cw.STUDY_DIR, user / "tabular", ignore=shutil.ignore_patterns("__pycache__", "data"))
    _, gcs_address, env = head
    run_the_study(user, {**env, "RAY_ADDRESS": gcs_address})


def run_the_study(user, env) -> None:
    subprocess.run([sys.executable, "tabular/write_data.py", "data"], cwd=user, check=True, timeout=120)
    out = playbook(user, env, "validate", "--data", "tabular/study.yaml")
    # 2 explore trials of 40 steps, then 2 exploit trials twice as long: 80 + 160 steps.
    assert out.stdout.startswith(
        "ok: study tabular-example: 2 round(s), 4 trials, 240 training steps, 2 worker(s) per trial"
    )

    with EnvironWatcher("TrainController") as controllers:
        run = playbook(user, env, "run", "tabular/study.yaml", timeout=1200)
    # Its 2-worker trials ran on reused workers (the default): no Ray Train run was started.
    assert controllers.seen == {}
    best = re.search(r"^best checkpoint: (\S+)$", run.stdout, re.M).group(1)
    assert best != "None" and os.path.isdir(best), run.stdout[-3000:]
    study_dir = user / "studies" / "tabular-example"
    rows = pq.read_table(str(study_dir / "trials.parquet")).to_pylist()
    assert sorted(r["trial_name"] for r in rows) == [
        "exploit-0000",
        "exploit-0001",
        "explore-0000",
        "explore-0001",
    ]
    assert {r["status"] for r in rows} == {"FINISHED"}
    with open(study_dir / "trials" / "explore-0000" / "topology.json") as f:
        assert len(json.load(f)["ranks"]) == 2
    with open(study_dir / "provenance.json") as f:
        record = json.load(f)
    assert record["workload"]["file"] == str(user / "tabular" / "tabular_workload.py")
    assert record["import_path"] == [str(user / "tabular"), str(user)]

    status = playbook(user, env, "status", "tabular/study.yaml")
    assert f"best checkpoint: {best}" in status.stdout
    report = playbook(user, env, "report", "tabular/study.yaml")
    assert (study_dir / "report.html").exists() and "report: " in report.stdout

    playbook(user, env, "eval", best, "--split", "test")
    evals = os.path.join(os.path.dirname(best), "evals", f"test-{os.path.basename(best)}")
    with open(os.path.join(evals, "metrics.json")) as f:
        metrics = json.load(f)
    preds = pq.read_table(os.path.join(evals, "predictions.parquet")).to_pandas()
    test = pq.read_table(str(user / "data" / "test"))
    assert sorted(preds["example_id"]) == sorted(test.column("row_id").to_pylist())  # id_column honoured

    # The checkpoint's error on the test split, from a plain torch pass over the parquet columns.
    state = checkpoint.load(best)
    model = cw.TabularMLP().build_model(state.hparams)
    model.load_state_dict(state.model)
    x = np.stack([test.column(f"f{i}").to_numpy() for i in range(cw.NUM_FEATURES)], axis=1)
    with torch.no_grad():
        predicted = model.eval()(torch.from_numpy(x.astype(np.float32))).argmax(1).numpy()
    wrong = predicted != test.column("y").to_numpy()
    assert metrics["error"] == pytest.approx(wrong.mean())
    by_id = dict(zip(test.column("row_id").to_pylist(), wrong.astype(float), strict=True))
    np.testing.assert_array_equal(preds["metric/error"], [by_id[i] for i in preds["example_id"]])


def test_ray_job_submit_imports_the_workload_beside_a_study_in_a_subfolder(head, tmp_path):
    """`ray job submit --working-dir USER -- playbook run tabular/study.yaml`: the job's driver
    and its trial's worker (in the uploaded copy of USER, on a head started elsewhere) import
    `tabular_workload` from the study file's folder, a subfolder of the working directory."""
    user = tmp_path / "user"
    shutil.copytree(cw.STUDY_DIR, user / "tabular", ignore=shutil.ignore_patterns("__pycache__", "data"))
    subprocess.run([sys.executable, "tabular/write_data.py", "data"], cwd=user, check=True, timeout=120)
    study_file = user / "tabular" / "study.yaml"
    d = yaml.safe_load(study_file.read_text())
    d.update(
        storage=str(tmp_path / "storage"),  # outside the uploaded copy, for the test to read
        scaling={"num_hosts": 1, "workers_per_host": 1},
        rounds=[{"name": "explore", "num_trials": 1}],
    )
    d["training"].update(max_train_steps=8, eval_every_steps=8)
    study_file.write_text(yaml.safe_dump(d))
    address, _, env = head
    submit = [f"{BIN}/ray", "job", "submit", "--no-wait", "--address", address, "--working-dir"]
    submit += [str(user), "--", "playbook", "run", "tabular/study.yaml"]
    out = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    job_id = re.search(r"raysubmit_\w+", out.stdout + out.stderr).group(0)
    state, logs = wait_for_job(address, job_id, env, timeout_s=600)
    assert state == "SUCCEEDED", logs[-4000:]
    rows = pq.read_table(str(tmp_path / "storage" / "tabular-example" / "trials.parquet")).to_pylist()
    assert [(r["trial_name"], r["status"]) for r in rows] == [("explore-0000", "FINISHED")]
