"""Study builders and checks shared by the tests: small valid studies as plain data or
loaded, a study run under a time limit, and independent comparisons of checkpoint contents."""

from __future__ import annotations

import copy
import threading
import time

import pyarrow.parquet as pq

from service.study import spec

MINIMAL_STUDY = {
    "name": "tiny",
    "workload": "digits",
    "data": {"train": "d/train", "validation": "d/val"},
    "training": {"max_train_steps": 100, "batch_size": 32, "eval_every_steps": 10},
    "search": {"learning_rate": {"role": "nuisance", "min": 0.01, "max": 1}},
    "rounds": [{"name": "r1", "num_trials": 4}],
}
"""The smallest valid study file, as plain data."""


BASE_STUDY = {
    "name": "t",
    "workload": "digits",
    "data": {},
    "storage": "",
    "training": {
        "max_train_steps": 40,
        "batch_size": 32,
        "eval_batch_size": 64,
        "eval_every_steps": 20,
        "num_checkpoints_to_keep": 2,
        "metric": "validation/loss",
        "mode": "min",
        "seed": 0,
        "schedule": {"kind": "cosine", "warmup_steps": 5},
    },
    "search": {
        "learning_rate": {"role": "nuisance", "type": "float", "min": 0.01, "max": 0.5, "scale": "log"},
        "momentum": {"role": "nuisance", "type": "float", "min": 0.5, "max": 0.95},
        "width": {"role": "fixed", "value": 4},
    },
    "rounds": [{"name": "explore", "num_trials": 2}],
}


TRIAL_LAYOUTS = {
    "fast-path": {"num_hosts": 1, "workers_per_host": 1},
    "pool": {"num_hosts": 1, "workers_per_host": 2},
    "ray-train": {"num_hosts": 1, "workers_per_host": 2, "reuse_workers": False},
}
"""The three ways a trial trains, as `scaling` sections: one worker in its Tune trial, two on
reused workers (the default for several), two as a Ray Train run of its own."""


def study_dict(digits_dir, storage, **overrides) -> dict:
    """A small valid study as plain data; `overrides` replace top-level keys, and
    `training={...}` is merged into the training section."""
    d = copy.deepcopy(BASE_STUDY)
    d["data"] = {s: str(digits_dir / s) for s in ("train", "validation", "test")}
    d["storage"] = str(storage)
    training = overrides.pop("training", {})
    d["training"].update(training)
    d.update(overrides)
    return d


def make_study(digits_dir, storage, **overrides) -> spec.Study:
    return spec.load_dict(study_dict(digits_dir, storage, **overrides))


def same_nested(a, b) -> bool:
    """Equality of nested dicts/lists/tuples whose leaves may be tensors (checkpointed RNG
    states, model state dicts)."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_nested(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same_nested(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def digits_logits(state, split_dir) -> tuple:
    """(logits as float64 numpy, labels) of a checkpoint's digits model over a whole split,
    read with pyarrow directly: an evaluation independent of the service's eval path."""
    import numpy as np
    import torch

    from service import workloads

    model = workloads.get("digits").build_model(state.hparams or {"width": 4})
    model.load_state_dict(state.model)
    model.eval()
    table = pq.read_table(str(split_dir))
    x = np.stack(table.column("pixels").to_numpy(zero_copy_only=False)).astype(np.float32)
    with torch.no_grad():
        logits = model(torch.from_numpy(x).view(-1, 1, 8, 8)).double().numpy()
    return logits, table.column("label").to_numpy()


STUDY_TIMEOUT_S = 420  # a hang (a worker group that never starts) fails the test instead


def run_within_timeout(study) -> list[dict]:
    """The study's trial rows, run on the connected Ray; a study still running after
    STUDY_TIMEOUT_S fails the test."""
    from service.orchestration.study_run import run_study

    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(rows=run_study(study)), daemon=True)
    thread.start()
    thread.join(STUDY_TIMEOUT_S)
    assert "rows" in out, f"study {study.name} did not finish within {STUDY_TIMEOUT_S} s"
    return out["rows"]


def folder_state(root) -> dict[str, tuple]:
    """Every file and folder under `root` (relative path -> (bytes or None for a folder,
    mtime_ns)): equal before and after means nothing there was written, added or removed."""
    import os

    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            data = None
            if name in files:
                with open(path, "rb") as f:
                    data = f.read()
            out[os.path.relpath(path, root)] = (data, os.stat(path).st_mtime_ns)
    return out


def free_cpus_after_study() -> float:
    """The session cluster's free CPUs once the study is over (Ray frees resources a moment
    after a placement group is removed): all of them, unless a group was left behind."""
    import ray

    deadline = time.time() + 30
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"] and time.time() < deadline:
        time.sleep(0.5)
    return ray.available_resources().get("CPU", 0)
