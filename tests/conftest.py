"""Shared fixtures: the digits parquet data, study builders, one Ray cluster per test session."""

from __future__ import annotations

import copy
import os
import signal
import socket
import time

import pytest

from service.data.builtin import write_digits
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


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("digits")
    write_digits(str(root))
    return root


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


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster shared by every test that needs Ray."""
    import ray

    from service.orchestration.coordinator import NAMESPACE

    ray.init(
        address="local",  # a new cluster, never one that another process started on this machine
        num_cpus=2,
        namespace=NAMESPACE,
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONUNBUFFERED": "1"}},
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory):
    """gs://<bucket> on a gcp-storage-emulator on loopback (see tests/_gcs.py)."""
    try:
        from _gcs import emulated_bucket
    except ImportError:
        from tests._gcs import emulated_bucket

    yield from emulated_bucket(str(tmp_path_factory.mktemp("gcs")))


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def session_pids(sid: int) -> list[int]:
    """Every process in session `sid` (what a `setsid`-started `ray start --head` spawned)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[3]) == sid:
                    pids.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return pids


def end_session(proc) -> None:
    """Wait for the processes of the killed driver's session (its embedded Ray) to go; kill
    what is left of them, by pid (all of them were started by this test)."""
    deadline = time.time() + 60
    while session_pids(proc.pid) and time.time() < deadline:
        time.sleep(0.5)
    for pid in session_pids(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


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
    import pyarrow.parquet as pq
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
