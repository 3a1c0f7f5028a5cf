"""step_ratio: steps/s of the service's step loop (trainer.loop.train, one process, no Ray)
over a bare PyTorch loop of the same model, optimizer, batch size and data in memory.
bf16_speedup: steps/s of the same service loop with `training.precision: bf16` over fp32,
measured in the same run (on a CPU without bf16 arithmetic it can be below 1).

Both are paired ratios (`common.paired_ratio`): short blocks of the two loops interleaved in
one process, one torch thread each, the median of the pairs' ratios; step_ratio pools the
pairs of `PROCESSES` fresh processes (`common.paired_in_processes`: a process's memory layout
moved the median of its pairs by a point or two either way). The value counts steps
per CPU second of this process (all its threads: the service's prefetch and read threads are
charged to it; `common.CpuClock`), which background load hardly moves; the same ratio in wall
seconds is in the raw figures (`wall_ratio`). On a loaded 2-CPU host the wall ratio is biased,
not only noisy: the scheduler favours the service's loop, which briefly waits on its prefetch
thread, over the bare loop, which never sleeps (see docs/performance.md).

    python -m bench.step            (python -m bench.step --pairs: one process's pairs)
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

import pyarrow.parquet as pq
import torch

from bench.common import (
    Rates,
    block_rates,
    figure,
    paired_in_processes,
    paired_rates,
    paired_ratio,
    paired_raw,
    run_trial,
    single_trial_study,
)
from service import workloads
from service.data.builtin import write_digits

STEPS, BATCH, PROCESSES, PAIRS, BF16_PAIRS, THREADS = 200, 64, 7, 7, 9, 1
HPARAMS = {"learning_rate": 0.05, "momentum": 0.9, "width": 16, "weight_decay": 0.0}


def service_rates(data_dir: str, storage: str, precision: str = "fp32") -> Rates:
    training = {"max_train_steps": STEPS, "batch_size": BATCH, "precision": precision}
    study = single_trial_study("bench-step", "digits", data_dir, storage, training, HPARAMS["learning_rate"])
    row = run_trial(study, HPARAMS)
    return {"wall": row["steps_per_s"], "cpu": row["steps_per_cpu_s"]}


class Bare:
    """What one writes by hand: tensors in memory, a permutation per epoch, the usual 5 lines.
    The data is read once; each block builds its model and optimizer as a trial does."""

    def __init__(self, data_dir: str):
        table = pq.read_table(f"{data_dir}/train")
        pixels = table.column("pixels").combine_chunks().flatten().to_numpy().reshape(-1, 1, 8, 8)
        self.x = torch.from_numpy(pixels.copy())  # writable (torch warns on a read-only array)
        self.y = torch.from_numpy(table.column("label").to_numpy())

    def rates(self) -> Rates:
        x, y = self.x, self.y
        torch.manual_seed(0)
        model = workloads.get("digits").build_model(HPARAMS)
        opt = torch.optim.SGD(model.parameters(), lr=HPARAMS["learning_rate"], momentum=HPARAMS["momentum"])
        perm, pos = torch.randperm(len(y)), 0
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(STEPS):
            if pos + BATCH > len(y):
                perm, pos = torch.randperm(len(y)), 0
            i = perm[pos : pos + BATCH]
            pos += BATCH
            loss = torch.nn.functional.cross_entropy(model(x[i]), y[i])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return block_rates(STEPS, wall, cpu)


def fp32_pairs() -> dict:
    """`PAIRS` pairs of the service's fp32 loop and the bare loop, in this process."""
    torch.set_num_threads(THREADS)
    with tempfile.TemporaryDirectory(prefix="playbook-bench-step-") as tmp:
        data, storage = f"{tmp}/data", f"{tmp}/studies"
        write_digits(data)
        return paired_rates(lambda: service_rates(data, storage), Bare(data).rates, PAIRS)


def run() -> dict:
    fp32 = paired_in_processes("bench.step", PROCESSES)
    torch.set_num_threads(THREADS)
    with tempfile.TemporaryDirectory(prefix="playbook-bench-step-") as tmp:
        data, storage = f"{tmp}/data", f"{tmp}/studies"
        write_digits(data)
        bf16 = paired_ratio(
            lambda: service_rates(data, storage, "bf16"), lambda: service_rates(data, storage), BF16_PAIRS
        )
    common = {"steps": STEPS, "batch_size": BATCH, "threads": THREADS}
    return {
        "bf16_speedup": figure(
            "bf16_speedup",
            bf16["cpu"]["ratio"],
            bf16_steps_per_s=bf16["cpu"]["service"],
            fp32_steps_per_s=bf16["cpu"]["baseline"],
            **paired_raw(bf16, "cpu", "steps/CPU s"),
            wall_steps_per_s=[bf16["wall"]["service"], bf16["wall"]["baseline"]],
            **common,
        ),
        "step_ratio": figure(
            "step_ratio",
            fp32["cpu"]["ratio"],
            service_steps_per_s=fp32["cpu"]["service"],
            bare_steps_per_s=fp32["cpu"]["baseline"],
            **paired_raw(fp32, "cpu", "steps/CPU s"),
            processes=fp32["processes"],
            wall_steps_per_s=[fp32["wall"]["service"], fp32["wall"]["baseline"]],
            **common,
        ),
    }


if __name__ == "__main__":
    if sys.argv[1:] == ["--pairs"]:  # one process's share of the pairs (`paired_in_processes`)
        print(json.dumps(fp32_pairs()))
    else:
        print(json.dumps(run(), indent=1))
