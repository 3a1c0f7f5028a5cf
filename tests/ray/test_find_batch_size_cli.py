"""`playbook find-batch-size` from a user's side: the installed command, run from another
folder than the study file's, against a Ray cluster (the session's, through RAY_ADDRESS),
writes its table under the study's storage and prints the playbook's reading."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import yaml

from tests.helpers.studies import study_dict

PLAYBOOK = os.path.join(os.path.dirname(sys.executable), "playbook")
"""The installed command (the project's console script, beside the interpreter)."""


def chosen_size(rows: list[dict], min_gain: float) -> int | None:
    """The rule written again as a plain loop: up from the smallest size, the last one reached
    through doublings that each fit and add at least `min_gain` examples/s."""
    best = None
    for row in rows:
        if not row["fits"] or (best and row["examples_per_s"] < (1 + min_gain) * best["examples_per_s"]):
            break
        best = row
    return best and best["per_worker_batch"]


def test_find_batch_size_on_digits_writes_its_table(ray_cluster, digits_dir, tmp_path):
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    d = study_dict(digits_dir, "runs", scaling={"num_hosts": 1, "workers_per_host": 2})
    (project / "study.yaml").write_text(yaml.safe_dump(d))  # storage "runs": against the cwd
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    out = subprocess.run(
        [PLAYBOOK, "find-batch-size", "../project/study.yaml", "--max", "16", "--steps", "2"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]

    stored = elsewhere / "runs" / "t"
    text = (stored / "batch_size.txt").read_text()
    table = text.splitlines()
    record = json.loads((stored / "batch_size.json").read_text())
    rows = record["rows"]
    sizes = [r["per_worker_batch"] for r in rows]
    assert sizes == [8, 16][: len(sizes)]
    assert all(r["examples_per_s"] > 0 for r in rows if r["fits"])
    assert {r["device"] for r in rows} == {"cpu: 1 thread(s)"}  # one worker's CPUs (cpus_per_worker 1)
    chosen = chosen_size(rows, record["min_gain"])
    assert (record["per_worker_batch"], record["global_batch"]) == (chosen, 2 * chosen)

    assert table[0].startswith("per-worker  global  examples/s")
    assert [line.split()[0] for line in table[1 : 1 + len(rows)]] == [str(s) for s in sizes]
    assert table[-1] == record["message"] and "changing it means retuning" in record["message"]
    assert out.stdout.startswith(text)  # printed as written
