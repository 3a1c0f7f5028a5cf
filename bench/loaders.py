"""Loader figures: examples/s against raw pyarrow + numpy and against torch's DataLoader, the
exposed input time with CPU-heavy preprocessing, and peak RSS on a 10x larger dataset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, Dataset

from bench.common import figure, median_of, write_digits_like
from bench.loader_adapter import heavy_preprocess, service_batches

NUM_ROWS, NUM_FILES, BATCH = 100_000, 8, 256
REPEATS = 3
STEPS = 300
"""Steps of the exposed-input loop: three windows of rows, so the input must keep up."""
WORKERS = 1
"""Input worker processes of the exposed-input loop: the step keeps one of the 2 cores, and one
worker keeps up (a window's preprocessing, ~0.6 s, is less than its ~100 steps take)."""


def read_numpy(train_dir: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The hand-written baseline's read: one read_table, columns to numpy."""
    table = pq.read_table(train_dir, columns=["example_id", "pixels", "label"])
    pixels = table.column("pixels").combine_chunks().flatten().to_numpy().reshape(-1, 1, 8, 8)
    return pixels, table.column("label").to_numpy(), table.column("example_id").to_numpy()


def pyarrow_epoch(train_dir: str) -> int:
    pixels, labels, ids = read_numpy(train_dir)
    perm = np.random.default_rng(0).permutation(len(labels))
    n = 0
    for start in range(0, len(perm) - BATCH + 1, BATCH):
        i = perm[start : start + BATCH]
        batch = {"features": torch.from_numpy(pixels[i]), "label": torch.from_numpy(labels[i])}
        n += len(batch["label"])
    return n


class Rows(Dataset):
    """The DataLoader way: a map-style dataset of single examples."""

    def __init__(self, train_dir: str):
        self.pixels, self.labels, _ = read_numpy(train_dir)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        return torch.from_numpy(self.pixels[i]), int(self.labels[i])


def dataloader_epoch(train_dir: str) -> int:
    loader = DataLoader(Rows(train_dir), batch_size=BATCH, shuffle=True, num_workers=2, drop_last=True)
    return sum(len(labels) for _, labels in loader)


def service_epoch(train_dir: str) -> int:
    return sum(len(b["label"]) for b in service_batches(train_dir, BATCH, NUM_ROWS // BATCH))


def examples_per_s(fn, train_dir: str) -> float:
    t = time.perf_counter()
    n = fn(train_dir)
    return n / (time.perf_counter() - t)


def exposed_fraction(
    train_dir: str, num_steps: int = STEPS, prefetch_batches: int = 2, num_workers: int = 0
) -> dict:
    """Training the digits net on a CPU-heavy preprocessing workload, with `prefetch_batches`
    batches prefetched on a thread (0: none) or `num_workers` input worker processes: the
    share of the loop spent waiting for input. The first batch is drawn before the clock
    starts: it waits for the pipeline to fill (worker start, a whole window's preprocessing),
    once per run, and is reported apart."""
    from service import workloads

    workload = workloads.get("digits")
    torch.manual_seed(0)
    model = workload.build_model({"width": 16})
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    t = time.perf_counter()
    batches = service_batches(
        train_dir,
        BATCH,
        num_steps + 1,
        preprocess=heavy_preprocess,
        prefetch_batches=prefetch_batches,
        num_workers=num_workers,
    )
    first = next(batches)
    first_wait = time.perf_counter() - t
    waited, start = 0.0, time.perf_counter()
    for step in range(num_steps):
        t = time.perf_counter()
        batch = first if step == 0 else next(batches)
        waited += time.perf_counter() - t
        loss = workload.loss(model(batch["features"]), batch).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    wall = time.perf_counter() - start
    return {"fraction": waited / wall, "wait_s": waited, "wall_s": wall, "first_batch_wait_s": first_wait}


def peak_rss_mb(train_dir: str, num_batches: int) -> float:
    """Peak RSS of a fresh process that imports the service and draws `num_batches` batches."""
    code = (
        "import resource, sys; from bench.loader_adapter import service_batches; "
        "n = sum(len(b['label']) for b in service_batches(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))); "
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, train_dir, str(BATCH), str(num_batches)],
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    return float(out.stdout.split()[-1])


def run() -> dict:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="playbook-bench-data-") as tmp:
        base = write_digits_like(os.path.join(tmp, "base"), NUM_ROWS, NUM_FILES)
        svc, pa_rates, dl_rates = [], [], []
        for _ in range(REPEATS):  # interleaved, so load drifts hit all three alike
            svc.append(examples_per_s(service_epoch, base))
            pa_rates.append(examples_per_s(pyarrow_epoch, base))
            dl_rates.append(examples_per_s(dataloader_epoch, base))
        med = lambda v: float(np.median(v))  # noqa: E731
        results = {
            "loader_vs_pyarrow": figure(
                "loader_vs_pyarrow",
                med(svc) / med(pa_rates),
                service_examples_per_s=med(svc),
                pyarrow_examples_per_s=med(pa_rates),
                rows=NUM_ROWS,
                batch_size=BATCH,
                repeats=REPEATS,
            ),
            "loader_vs_dataloader": figure(
                "loader_vs_dataloader",
                med(svc) / med(dl_rates),
                service_examples_per_s=med(svc),
                dataloader_examples_per_s=med(dl_rates),
                num_workers=2,
            ),
        }
        # Heavy preprocessing in Python holds the GIL: a prefetch thread cannot run it beside
        # the step, worker processes can (the figure); the thread and no prefetch for reference.
        median_run = lambda runs: sorted(runs, key=lambda r: r["fraction"])[len(runs) // 2]  # noqa: E731
        workers = median_run([exposed_fraction(base, num_workers=WORKERS) for _ in range(REPEATS)])
        thread = median_run([exposed_fraction(base) for _ in range(REPEATS)])
        unfetched = median_run([exposed_fraction(base, prefetch_batches=0) for _ in range(REPEATS)])
        results["exposed_input_fraction"] = figure(
            "exposed_input_fraction",
            workers["fraction"],
            input_wait_s=workers["wait_s"],
            loop_wall_s=workers["wall_s"],
            first_batch_wait_s=workers["first_batch_wait_s"],
            steps=STEPS,
            input_workers=f"processes, num_input_workers={WORKERS}",
            prefetch_thread=thread["fraction"],
            prefetch_thread_wait_s=thread["wait_s"],
            prefetch_batches=2,
            without_prefetch=unfetched["fraction"],
            without_prefetch_wait_s=unfetched["wait_s"],
        )
        big = write_digits_like(os.path.join(tmp, "big"), 10 * NUM_ROWS, 10 * NUM_FILES, seed=1)
        batches = 200
        base_rss, _ = median_of(lambda: peak_rss_mb(base, batches), 1)
        big_rss, _ = median_of(lambda: peak_rss_mb(big, batches), 1)
        results["loader_peak_rss_ratio"] = figure(
            "loader_peak_rss_ratio",
            big_rss / base_rss,
            base_rows=NUM_ROWS,
            big_rows=10 * NUM_ROWS,
            base_peak_rss_mb=base_rss,
            big_peak_rss_mb=big_rss,
            batches_drawn=batches,
        )
    return results


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
