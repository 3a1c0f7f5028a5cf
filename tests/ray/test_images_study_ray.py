"""studies/images.yaml, made tiny, on the shared Ray cluster: the PNG image workload trained
through both rounds, then each trial's best checkpoint evaluated by a plain torch loop over the
validation PNGs decoded with PIL here: its error is the reported one, its argmax the saved
predictions. The input timings show the online decoding and augmentation."""

from __future__ import annotations

import io
import json
import math
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from PIL import Image

from service import workloads
from service.data.images import write_images
from service.distributed import checkpoint
from service.study import spec
from tests.helpers.studies import run_within_timeout

pytestmark = pytest.mark.ray
STUDY_FILE = os.path.join(os.path.dirname(__file__), "..", "..", "studies", "images.yaml")
STEPS, EVERY = 12, 4


@pytest.fixture(scope="module")
def finished(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    write_images(str(root / "data"), 300, seed=0)  # 240 training images, 30 validation
    with open(STUDY_FILE) as f:
        d = yaml.safe_load(f)
    d["data"] = {s: str(root / "data" / s) for s in ("train", "validation", "test")}
    d["storage"] = str(root / "studies")
    d["training"].update(max_train_steps=STEPS, eval_every_steps=EVERY, batch_size=16, eval_batch_size=32)
    d["training"]["schedule"]["warmup_steps"] = 2
    d["search"].update(width={"role": "fixed", "value": 4}, stages={"role": "fixed", "value": 2})
    d["rounds"][0]["num_trials"] = 2
    study = spec.load_dict(d)
    return study, run_within_timeout(study), root / "data" / "validation"


def hand_eval(state, validation_dir) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(example ids, argmax, labels) of a checkpoint's model over the validation PNGs, decoded
    with PIL, in eval mode, no augmentation."""
    table = pq.read_table(validation_dir)
    pixels = np.stack([np.asarray(Image.open(io.BytesIO(b))) for b in table.column("png").to_pylist()])
    model = workloads.get("images").build_model(state.hparams)
    model.load_state_dict(state.model)
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(pixels.transpose(0, 3, 1, 2).copy()))
    ids, labels = (table.column(c).to_numpy() for c in ("example_id", "label"))
    return ids, logits.argmax(1).numpy(), labels


def read_log(study, trial: str) -> list[dict]:
    with open(study.layout.trial(trial).metrics_log) as f:
        return [json.loads(line) for line in f]


def test_both_rounds_finish_and_round_two_extends_the_best(finished):
    _, rows, _ = finished
    assert [r["status"] for r in rows] == ["FINISHED"] * 3
    explore = [r for r in rows if r["round"] == "explore"]
    (exploit,) = [r for r in rows if r["round"] == "exploit"]
    best = min(explore, key=lambda r: (r["best_metric"], r["trial_name"]))
    assert exploit["max_train_steps"] == 2 * STEPS
    for hp in ("learning_rate", "momentum", "augment"):
        assert exploit[f"hp/{hp}"] == best[f"hp/{hp}"]


def test_the_best_checkpoint_reproduces_its_error_in_a_plain_torch_loop(finished):
    study, rows, validation_dir = finished
    for row in rows:
        state = checkpoint.load(row["best_checkpoint"])
        assert state.step == row["best_step"]
        ids, argmax, labels = hand_eval(state, validation_dir)
        assert math.isclose(float((argmax != labels).mean()), row["best_metric"], abs_tol=1e-12)
        saved = pq.read_table(study.layout.trial(row["trial_name"]).predictions("validation", state.step))
        by_id = dict(
            zip(saved.column("example_id").to_pylist(), saved.column("prediction").to_pylist(), strict=True)
        )
        assert [by_id[i] for i in ids.tolist()] == argmax.tolist()


def test_the_input_timings_show_decoding_and_augmentation(finished):
    study, rows, _ = finished
    for row in rows:
        log = read_log(study, row["trial_name"])
        assert [r["step"] for r in log] == list(range(EVERY, row["max_train_steps"] + 1, EVERY))
        assert sum(r["input/preprocess_s"] for r in log) > 0  # the PNGs decoded online
        if row["hp/augment"]:
            assert sum(r["input/augment_s"] for r in log) > 0
