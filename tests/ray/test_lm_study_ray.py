"""studies/lm.yaml at a tiny size on the shared Ray cluster (a tiny model on a small corpus, a few
eval points, both rounds): each trial's best checkpoint, evaluated again by a plain torch loop
over the validation sequences (sum of token losses / real tokens), gives the validation loss and
bits per byte the trial reported; the predictions are one row per sequence."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from service import workloads
from service.data import text
from service.distributed import checkpoint
from service.study import spec
from tests.helpers.lm_reference import corpus_rows, plain_token_losses

pytestmark = pytest.mark.ray
STUDY_FILE = Path(__file__).resolve().parents[2] / "studies" / "lm.yaml"
SEQ_LEN, MAX_STEPS, EVERY = 32, 12, 4
TINY = {"depth": {"role": "fixed", "value": 1}, "heads": {"role": "fixed", "value": 2}}


def tiny_study(data_dir, storage) -> spec.Study:
    """The example study, shrunk: data, storage, steps, batches, widths and trials."""
    raw = yaml.safe_load(STUDY_FILE.read_text())
    raw["data"] = {s: str(data_dir / s) for s in ("train", "validation")}
    raw["storage"] = str(storage)
    raw["training"].update(
        {"max_train_steps": MAX_STEPS, "eval_every_steps": EVERY, "batch_size": 8, "eval_batch_size": 16}
    )
    raw["training"]["schedule"]["warmup_steps"] = 2
    raw["search"].update({**TINY, "width": {"role": "scientific", "type": "choice", "values": [8, 16]}})
    raw["rounds"][0]["num_trials"] = 2
    return spec.load_dict(raw)


@pytest.fixture(scope="module")
def finished(ray_cluster, tmp_path_factory):
    from service.orchestration.study_run import run_study

    root = tmp_path_factory.mktemp("lm")
    text.write_text(str(root / "data"), 16_000, SEQ_LEN)
    study = tiny_study(root / "data", root / "studies")
    return study, run_study(study), root / "data"


def logged(study, trial_name: str, step: int) -> dict:
    """The trial's metrics-log row of `step`."""
    with open(study.layout.trial(trial_name).metrics_log) as f:
        return next(r for r in map(json.loads, f) if r["step"] == step)


def test_both_rounds_finish(finished):
    _, rows, _ = finished
    assert sorted((r["round"], r["status"], r["step"]) for r in rows) == [
        ("exploit", "FINISHED", 2 * MAX_STEPS),
        ("explore", "FINISHED", MAX_STEPS),
        ("explore", "FINISHED", MAX_STEPS),
    ]


def test_best_checkpoints_reproduce_loss_and_bits_per_byte(finished):
    study, rows, data_dir = finished
    validation = corpus_rows(str(data_dir / "validation"))
    for row in rows:
        state = checkpoint.load(row["best_checkpoint"])
        model = workloads.get("lm").build_model(state.hparams)
        model.load_state_dict(state.model)
        total, count = plain_token_losses(model, validation)
        log = logged(study, row["trial_name"], state.step)
        assert log["validation/loss"] == pytest.approx(total / count, rel=1e-5)
        assert row["best_metric"] == log["validation/bits_per_byte"]
        assert row["best_metric"] == pytest.approx(total / count / math.log(2), rel=1e-5)


def test_predictions_are_one_row_per_sequence(finished):
    study, rows, data_dir = finished
    validation = corpus_rows(str(data_dir / "validation"))
    row = rows[0]
    table = pq.read_table(study.layout.trial(row["trial_name"]).predictions("validation", EVERY))
    assert "output" not in table.column_names
    np.testing.assert_array_equal(table["example_id"].to_numpy(), [r["example_id"] for r in validation])
    np.testing.assert_array_equal(table["weight"].to_numpy(), [r["num_tokens"] for r in validation])
    weight = table["weight"].to_numpy().astype(np.float64)
    loss = np.sum(table["metric/loss"].to_numpy() * weight) / np.sum(weight)
    assert loss == pytest.approx(logged(study, row["trial_name"], EVERY)["validation/loss"], rel=1e-9)
