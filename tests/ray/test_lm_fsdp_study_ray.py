"""studies/lm-fsdp.yaml at a tiny size on the shared Ray cluster, through the coordinator and
Tune (one trial over 2 workers, its model sharded): the trial's best checkpoint is sharded (one
file per worker), and `playbook eval`'s Ray Train run on one worker reads it whole and gives the
trial's own validation loss at that step exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from service.core import storage
from service.data import text
from service.evaluation.offline import metrics_uri
from service.study import spec

pytestmark = pytest.mark.ray
STUDY_FILE = Path(__file__).resolve().parents[2] / "studies" / "lm-fsdp.yaml"
SEQ_LEN = 32


def tiny_study(data_dir, storage_dir) -> spec.Study:
    raw = yaml.safe_load(STUDY_FILE.read_text())
    raw["data"] = {s: str(data_dir / s) for s in ("train", "validation")}
    raw["storage"] = str(storage_dir)
    raw["training"].update(
        {"max_train_steps": 8, "eval_every_steps": 4, "batch_size": 8, "eval_batch_size": 16}
    )
    raw["training"]["schedule"]["warmup_steps"] = 2
    raw["search"].update(
        {
            "width": {"role": "fixed", "value": 16},
            "depth": {"role": "fixed", "value": 1},
            "heads": {"role": "fixed", "value": 2},
            "context": {"role": "fixed", "value": SEQ_LEN},
        }
    )
    raw["rounds"] = [{"name": "explore", "num_trials": 1}]
    return spec.load_dict(raw)


def test_an_fsdp_study_keeps_sharded_checkpoints_that_evaluate_on_one_worker(ray_cluster, tmp_path):
    from service.orchestration.offline_eval import run_offline_eval
    from service.orchestration.study_run import run_study

    text.write_text(str(tmp_path / "data"), 16_000, SEQ_LEN)
    study = tiny_study(tmp_path / "data", tmp_path / "studies")
    (row,) = run_study(study)
    assert (row["status"], row["step"]) == ("FINISHED", 8)
    best = row["best_checkpoint"]
    assert sorted(p.name for p in (Path(best) / "model").glob("__*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]

    run_offline_eval(best, "validation", study, num_workers=1)
    result = json.loads(storage.read_bytes(metrics_uri(best, "validation")))
    with open(study.layout.trial(row["trial_name"]).metrics_log) as f:
        logged = next(r for r in map(json.loads, f) if r["step"] == row["best_step"])
    assert result["world_size"] == 1
    assert result["loss"] == logged["validation/loss"]
