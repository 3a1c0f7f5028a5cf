"""step_ratio: steps/s of the service's step loop (trainer.loop.train, one process, no Ray)
over a bare PyTorch loop of the same model, optimizer, batch size and data in memory.
bf16_speedup: steps/s of the same service loop with `training.precision: bf16` over fp32,
measured in the same run (on a CPU without bf16 arithmetic it can be below 1).

Both are paired ratios (`common.paired_ratio`): short blocks of the two loops interleaved in
this process, one torch thread each, the median of the pairs' ratios.

    python -m bench.step
"""

from __future__ import annotations

import json
import tempfile
import time

import pyarrow.parquet as pq
import torch

from bench.common import figure, paired_ratio, run_trial, single_trial_study
from service import workloads
from service.data.builtin import write_digits

STEPS, BATCH, PAIRS, BF16_PAIRS, THREADS = 200, 64, 21, 9, 1
HPARAMS = {"learning_rate": 0.05, "momentum": 0.9, "width": 16, "weight_decay": 0.0}


def service_steps_per_s(data_dir: str, storage: str, precision: str = "fp32") -> float:
    training = {
        "max_train_steps": STEPS,
        "batch_size": BATCH,
        "optimizer": "sgd_momentum",
        "schedule": {"kind": "constant"},
        "precision": precision,
    }
    study = single_trial_study("bench-step", "digits", data_dir, storage, training, HPARAMS["learning_rate"])
    return run_trial(study, HPARAMS)["steps_per_s"]


class Bare:
    """What one writes by hand: tensors in memory, a permutation per epoch, the usual 5 lines.
    The data is read once; each block builds its model and optimizer as a trial does."""

    def __init__(self, data_dir: str):
        table = pq.read_table(f"{data_dir}/train")
        pixels = table.column("pixels").combine_chunks().flatten().to_numpy().reshape(-1, 1, 8, 8)
        self.x = torch.from_numpy(pixels.copy())  # writable (torch warns on a read-only array)
        self.y = torch.from_numpy(table.column("label").to_numpy())

    def steps_per_s(self) -> float:
        x, y = self.x, self.y
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
    torch.set_num_threads(THREADS)
    with tempfile.TemporaryDirectory(prefix="playbook-bench-step-") as tmp:
        data, storage = f"{tmp}/data", f"{tmp}/studies"
        write_digits(data)
        bare = Bare(data)
        fp32 = paired_ratio(lambda: service_steps_per_s(data, storage), bare.steps_per_s, PAIRS)
        bf16 = paired_ratio(
            lambda: service_steps_per_s(data, storage, "bf16"),
            lambda: service_steps_per_s(data, storage),
            BF16_PAIRS,
        )
    common = {"steps": STEPS, "batch_size": BATCH, "threads": THREADS}
    return {
        "bf16_speedup": figure(
            "bf16_speedup",
            bf16["ratio"],
            bf16_steps_per_s=bf16["service"],
            fp32_steps_per_s=bf16["baseline"],
            spread=bf16["spread"],
            pair_ratios=bf16["pair_ratios"],
            pairs=BF16_PAIRS,
            load_avg_1m=bf16["load_avg_1m"],
            **common,
        ),
        "step_ratio": figure(
            "step_ratio",
            fp32["ratio"],
            service_steps_per_s=fp32["service"],
            bare_steps_per_s=fp32["baseline"],
            spread=fp32["spread"],
            pair_ratios=fp32["pair_ratios"],
            pairs=PAIRS,
            load_avg_1m=fp32["load_avg_1m"],
            **common,
        ),
    }


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
