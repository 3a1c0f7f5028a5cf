"""The image CNN workload's figures: `cnn_step_ratio`, images/s of the service's step loop
(trainer.loop.train, one process, no Ray) on PNG parquet data, decoded and augmented online by an
input worker process with prefetch, over a bare PyTorch loop of the same model, optimizer and
batch size over images already decoded into a tensor in memory (no decoding, no augmentation);
and `cnn_exposed_input_fraction`, the share of the service's step time spent waiting for input
(the loop's own `input/exposed_fraction`)."""

from __future__ import annotations

import io
import json
import statistics
import tempfile
import time

import numpy as np
import pyarrow.parquet as pq
import torch
from PIL import Image

from bench.common import figure
from bench.step import Discard
from service import workloads
from service.data.images import write_images
from service.data.process_input import process_source
from service.planning.trial import TrialPlan
from service.study import spec
from service.trainer import loop
from service.trainer.topology import Topology

COUNT, STEPS, BATCH, REPEATS = 4000, 100, 64, 3
HPARAMS = {"learning_rate": 0.05, "momentum": 0.9, "width": 16, "stages": 3, "weight_decay": 0.0}
INPUT = {"workers": "processes", "num_input_workers": 1, "prefetch_batches": 4}
"""One input worker process (`process_source`, as the Ray edge passes it for `input.workers:
processes`): the step keeps one of the 2 cores."""


def service_run(data_dir: str, storage: str) -> dict:
    """The loop's one eval row: its steps/s and its exposed input fraction."""
    study = spec.load_dict(
        {
            "name": "bench-cnn",
            "workload": "images",
            "data": {"train": f"{data_dir}/train", "validation": f"{data_dir}/validation"},
            "storage": storage,
            "training": {
                "max_train_steps": STEPS,
                "batch_size": BATCH,
                "eval_every_steps": STEPS,  # one eval + checkpoint, after the timed steps
                "optimizer": "sgd_momentum",
                "schedule": {"kind": "constant"},
            },
            "input": INPUT,
            "search": {"learning_rate": {"role": "fixed", "value": HPARAMS["learning_rate"]}},
            "rounds": [{"name": "r", "num_trials": 1}],
        }
    )
    plan = TrialPlan(study, f"r-{time.monotonic_ns()}", "r", dict(HPARAMS), STEPS)
    reporter = Discard()
    loop.train(plan, Topology(), reporter, batch_source=process_source(INPUT["num_input_workers"]))
    return reporter.rows[-1]


def decoded(data_dir: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The training images decoded once, up front: [n, 3, 32, 32] uint8, and the labels."""
    table = pq.read_table(f"{data_dir}/train", columns=["png", "label"])
    pixels = np.stack([np.asarray(Image.open(io.BytesIO(b))) for b in table.column("png").to_pylist()])
    return torch.from_numpy(pixels.transpose(0, 3, 1, 2).copy()), torch.from_numpy(
        table.column("label").to_numpy()
    )


def bare_images_per_s(x: torch.Tensor, y: torch.Tensor) -> float:
    """What one writes by hand: tensors in memory, a permutation per epoch, the usual 5 lines."""
    torch.manual_seed(0)
    model = workloads.get("images").build_model(HPARAMS)
    opt = torch.optim.SGD(model.parameters(), lr=HPARAMS["learning_rate"], momentum=HPARAMS["momentum"])
    perm, pos = torch.randperm(len(y)), 0
    start = time.perf_counter()
    for _ in range(STEPS):
        if pos + BATCH > len(y):
            perm, pos = torch.randperm(len(y)), 0
        i = perm[pos : pos + BATCH]
        pos += BATCH
        loss = torch.nn.functional.cross_entropy(model(x[i]), y[i])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return STEPS * BATCH / (time.perf_counter() - start)


def run() -> dict:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="playbook-bench-cnn-") as tmp:
        write_images(f"{tmp}/data", COUNT, seed=0)
        x, y = decoded(f"{tmp}/data")
        rows, bare = [], []
        for _ in range(REPEATS):
            rows.append(service_run(f"{tmp}/data", f"{tmp}/studies"))
            bare.append(bare_images_per_s(x, y))
    service = statistics.median(r["steps_per_s"] * BATCH for r in rows)
    exposed = statistics.median(r["input/exposed_fraction"] for r in rows)
    b = statistics.median(bare)
    raw = {"steps": STEPS, "batch_size": BATCH, "repeats": REPEATS, "threads": 1, "images": COUNT, **INPUT}
    return {
        "cnn_step_ratio": figure(
            "cnn_step_ratio", service / b, service_images_per_s=service, bare_images_per_s=b, **raw
        ),
        "cnn_exposed_input_fraction": figure(
            "cnn_exposed_input_fraction",
            exposed,
            each=[r["input/exposed_fraction"] for r in rows],
            preprocess_s=[r["input/preprocess_s"] for r in rows],
            augment_s=[r["input/augment_s"] for r in rows],
            **raw,
        ),
    }


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
