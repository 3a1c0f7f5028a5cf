"""A study as `playbook next` reads it, without Ray: the study file as plain data, a hand-made
trial row, and a study folder holding what a finished one-round study leaves (the stored
study file, its trial table, its verdicts)."""

from __future__ import annotations

import copy
import json
import pathlib

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from service.study import spec
from service.study.checks import resolve_paths

STUDY = {
    "name": "nx",
    "workload": "digits",
    "data": {"train": "d/train", "validation": "d/val"},
    "training": {"max_train_steps": 1000, "batch_size": 32, "eval_every_steps": 100},
    "search": {
        "learning_rate": {"role": "nuisance", "type": "float", "min": 0.01, "max": 0.5, "scale": "log"},
        "momentum": {"role": "nuisance", "type": "float", "min": 0.5, "max": 0.95},
        "width": {"role": "fixed", "value": 16},
    },
    "rounds": [{"name": "explore", "num_trials": 8}],
}
"""A study searching learning_rate (log) and momentum, one round of 8 trials of 1000 steps."""


def row(i, metric, lr=0.1, momentum=0.7, best_step=500, rnd="explore", **extra) -> dict:
    return {
        "trial_name": f"{rnd}-{i:04d}",
        "round": rnd,
        "status": "FINISHED",
        "best_metric": metric,
        "best_step": best_step,
        "step": 1000,
        "max_train_steps": 1000,
        "hp/learning_rate": lr,
        "hp/momentum": momentum,
        "hp/width": 16,
        **extra,
    }


def stored_study(tmp_path, **changes) -> pathlib.Path:
    """A study file whose study has run its one round as far as `playbook next` reads it: the
    stored (resolved) study file, a trial table of 3 finished trials of 4 (one FAILED) and the
    round's verdicts. Returns the study file's path."""
    data = {"train": str(tmp_path / "d/train"), "validation": str(tmp_path / "d/val")}  # from any folder
    d = {**copy.deepcopy(STUDY), "data": data, "storage": str(tmp_path / "runs"), **changes}
    del d["rounds"]
    d["rounds"] = [{"name": "explore", "num_trials": 4}]  # the file's last key
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    study = resolve_paths(spec.load_file(path))
    folder = pathlib.Path(study.study_uri)
    folder.mkdir(parents=True)
    (folder / "study.yaml").write_text(spec.dump_yaml(study))
    rows = [row(i, 0.1 + 0.01 * i) for i in range(3)] + [{**row(3, None), "status": "FAILED"}]
    pq.write_table(pa.Table.from_pylist(rows), folder / "trials.parquet")
    (folder / "verdicts.json").write_text(
        json.dumps([{"round": "explore", "verdicts": [], "scientific": ""}])
    )
    return path
