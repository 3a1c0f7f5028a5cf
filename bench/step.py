"""step_ratio: steps/s of the service's step loop (trainer.loop.train, one process, no Ray)
over a bare PyTorch loop of the same model, optimizer, batch size and data in memory.
bf16_speedup: steps/s of the same service loop with `training.precision: bf16` over fp32,
measured in the same run (on a CPU without bf16 arithmetic it can be below 1)."""

from __future__ import annotations

import json
import statistics
import tempfile
import time

import pyarrow.parquet as pq
import torch

from bench.common import figure
from service import workloads
from service.data.builtin import write_digits
from service.planning.trial import TrialPlan
from service.study import spec
from service.trainer import loop
from service.trainer.topology import Topology

STEPS, BATCH, REPEATS = 300, 64, 5
HPARAMS = {"learning_rate": 0.05, "momentum": 0.9, "width": 16, "weight_decay": 0.0}


class Discard:
    """A Reporter that keeps the eval rows only (no checkpoints; the loop's own measurement is in
    its rows)."""

    def __init__(self):
        self.rows = []

    def report(self, metrics, checkpoint_dir):
        self.rows.append(metrics)

    def restore(self):
        return None


def service_steps_per_s(data_dir: str, storage: str, precision: str = "fp32") -> float:
    study = spec.load_dict(
        {
            "name": "bench-step",
            "workload": "digits",
            "data": {"train": f"{data_dir}/train", "validation": f"{data_dir}/validation"},
            "storage": storage,
            "training": {
                "max_train_steps": STEPS,
                "batch_size": BATCH,
                "eval_every_steps": STEPS,  # one eval + checkpoint, after the timed steps
                "optimizer": "sgd_momentum",
                "schedule": {"kind": "constant"},
                "precision": precision,
            },
            "search": {"learning_rate": {"role": "fixed", "value": HPARAMS["learning_rate"]}},
            "rounds": [{"name": "r", "num_trials": 1}],
        }
    )
    plan = TrialPlan(study, f"r-{time.monotonic_ns()}", "r", dict(HPARAMS), STEPS)
    reporter = Discard()
    loop.train(plan, Topology(), reporter)
    return reporter.rows[-1]["steps_per_s"]


def bare_steps_per_s(data_dir: str) -> float:
    """What one writes by hand: tensors in memory, a permutation per epoch, the usual 5 lines."""
    table = pq.read_table(f"{data_dir}/train")
    pixels = table.column("pixels").combine_chunks().flatten().to_numpy().reshape(-1, 1, 8, 8)
    x = torch.from_numpy(pixels.copy())  # writable (torch warns on a read-only array)
    y = torch.from_numpy(table.column("label").to_numpy())
    torch.manual_seed(0)
    model = workloads.get("digits").build_model(HPARAMS)
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
    return STEPS / (time.perf_counter() - start)


def run() -> dict:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="playbook-bench-step-") as tmp:
        write_digits(f"{tmp}/data")
        service, bare, bf16 = [], [], []
        for _ in range(REPEATS):
            service.append(service_steps_per_s(f"{tmp}/data", f"{tmp}/studies"))
            bare.append(bare_steps_per_s(f"{tmp}/data"))
            bf16.append(service_steps_per_s(f"{tmp}/data", f"{tmp}/studies", "bf16"))
    s, b, h = statistics.median(service), statistics.median(bare), statistics.median(bf16)
    return {
        "bf16_speedup": figure(
            "bf16_speedup",
            h / s,
            bf16_steps_per_s=h,
            fp32_steps_per_s=s,
            steps=STEPS,
            batch_size=BATCH,
            repeats=REPEATS,
            threads=1,
        ),
        "step_ratio": figure(
            "step_ratio",
            s / b,
            service_steps_per_s=s,
            bare_steps_per_s=b,
            steps=STEPS,
            batch_size=BATCH,
            repeats=REPEATS,
            threads=1,
        ),
    }


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
