"""Two studies in a chain on the shared Ray cluster: study B's extend round builds on study
A's explore round (`from_round: chain-a/explore`, the same storage root). B reruns A's best
trial (picked here from A's stored trial table) twice as long, records where it came from, and
writes nothing into A's folder."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from service.study import spec
from service.study.stored import link_rounds
from tests.helpers.studies import folder_state, study_dict

pytestmark = pytest.mark.ray
STEPS, EVERY = 40, 20


@pytest.fixture(scope="module")
def chain(ray_cluster, digits_dir, tmp_path_factory):
    from service.orchestration.study_run import run_study

    storage = tmp_path_factory.mktemp("storage")
    training = {"max_train_steps": STEPS, "eval_every_steps": EVERY, "num_checkpoints_to_keep": 1}
    a = spec.load_dict(
        study_dict(
            digits_dir,
            storage,
            name="chain-a",
            training=training,
            rounds=[{"name": "explore", "num_trials": 3}],
        )
    )
    run_study(a)
    a_before = folder_state(a.study_uri)
    b_raw = study_dict(
        digits_dir,
        storage,
        name="chain-b",
        training=training,
        rounds=[{"name": "longer", "kind": "extend", "from_round": "chain-a/explore", "num_trials": 1}],
    )
    b = link_rounds(spec.load_dict(b_raw))
    b_rows = run_study(b)
    return a, b, a_before, b_rows


def test_b_extends_the_best_trial_of_a_for_twice_as_long(chain):
    a, b, _, b_rows = chain
    a_rows = pq.read_table(os.path.join(a.study_uri, "trials.parquet")).to_pylist()
    best = min(a_rows, key=lambda r: (r["best_metric"], r["trial_name"]))
    (row,) = b_rows
    assert row["status"] == "FINISHED" and row["trial_name"] == "longer-0000"
    assert row["extended_from"] == f"chain-a/{best['trial_name']}"
    assert row["max_train_steps"] == row["step"] == 2 * STEPS
    hps = [k for k in best if k.startswith("hp/")]
    assert {k: row[k] for k in hps} == {k: best[k] for k in hps}
    assert row["schedule_origin"].startswith(
        f"cosine schedule of chain-a/{best['trial_name']} ({STEPS} steps)"
    )
    # Cosine keeps the base LR and stretches: the learning rate at each evaluation follows the
    # 80-step curve (warmup 5), written out here.
    with open(os.path.join(b.study_uri, "trials", "longer-0000", "metrics.jsonl")) as f:
        log = [json.loads(line) for line in f]
    assert [r["step"] for r in log] == list(range(EVERY, 2 * STEPS + 1, EVERY))
    lr = best["hp/learning_rate"]
    for r in log:
        p = (r["step"] - 1 - 5) / (2 * STEPS - 5)
        assert r["learning_rate"] == pytest.approx(lr * 0.5 * (1 + math.cos(math.pi * p)), rel=1e-9)


def test_b_records_its_source_and_leaves_a_untouched(chain):
    a, b, a_before, _ = chain
    assert folder_state(a.study_uri) == a_before
    with open(b.layout.study_file) as f:
        stored = spec.load_text(f.read())
    assert stored.rounds[0].from_round == "chain-a/explore" and not stored.linked
    with open(b.layout.verdicts) as f:
        (summary,) = json.load(f)
    assert summary["round"] == "longer" and "chain-a/explore-000" in summary["scientific"]


def test_status_and_report_of_b_show_the_round_it_builds_on(chain, tmp_path):
    """Read from storage (no Ray to ask): the stored study is linked to chain-a again."""
    _, b, _, _ = chain
    env = {**os.environ, "RAY_ADDRESS": ""}
    for args in (["status", b.study_uri], ["report", b.study_uri, "--out", str(tmp_path / "b.html")]):
        out = subprocess.run(
            [sys.executable, "-m", "service", *args], capture_output=True, text=True, env=env, timeout=120
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert "longer: extend from chain-a/explore, 1 trial x 80 steps" in out.stdout
