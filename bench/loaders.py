"""Loader figures: examples/s against raw pyarrow + numpy and against torch's DataLoader, the
exposed input time with CPU-heavy preprocessing, and the peak RSS growth of an epoch on a 10x
larger dataset against that of as many batches on the base one.

The machine is shared with other work: each ratio is the median of ratios of runs interleaved
in pairs (a pair's runs see about the same load), and raw keeps their spread.

How loader_vs_pyarrow moves with the load: over runs of several epochs the loader spends about
the CPU per example that the baseline does (raw `cpu_per_example_ratio`), so on a quiet machine
the ratio is near 1. With other processes on the cores it rises: the loader keeps several
threads runnable (reading threads, prefetch thread, consumer) where the baseline keeps mostly one
busy (its epoch's wall time is about its CPU time), and the scheduler shares the cores by thread.
The spread between pairs is the load changing between a pair's two runs (a side's wall time
varies severalfold between runs of the same CPU time); their median is what is stable."""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, Dataset

from bench.common import ROOT, figure, write_digits_like
from bench.loader_adapter import heavy_preprocess, service_batches

NUM_ROWS, NUM_FILES, BATCH = 100_000, 8, 256
REPEATS = 15
"""Pairs of runs (service, pyarrow) for loader_vs_pyarrow, the order alternating."""
DATALOADER_PAIRS = 3
EPOCHS = 10
"""Epochs per run of the service's loader and of the pyarrow baseline: one stream over several
epochs, as training draws it. A stream's fixed costs (its threads, the footers, the first
window read before any batch, the window read ahead and dropped at close) are paid once per
run, as a trial pays them once; over 3 epochs (before issue 21's last change) they were a large
share of a run's CPU, so the figure measured the run length as much as the loader."""
EXPOSED_REPEATS = 3
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


def pyarrow_epochs(train_dir: str) -> int:
    """`EPOCHS` epochs of the hand-written baseline, each reading the files again (as the
    service's loader does without its cache)."""
    return sum(pyarrow_epoch(train_dir) for _ in range(EPOCHS))


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
        pixels, self.labels, _ = read_numpy(train_dir)
        self.pixels = pixels.copy()  # writable: torch.from_numpy warns on a read-only view

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        return torch.from_numpy(self.pixels[i]), int(self.labels[i])


def dataloader_epoch(train_dir: str) -> int:
    loader = DataLoader(Rows(train_dir), batch_size=BATCH, shuffle=True, num_workers=2, drop_last=True)
    return sum(len(labels) for _, labels in loader)


def service_epochs(train_dir: str) -> int:
    """`EPOCHS` epochs of the service's loader, one stream (opened in the run and closed at its
    end, the window read ahead past the last batch included)."""
    return sum(len(b["label"]) for b in service_batches(train_dir, BATCH, EPOCHS * NUM_ROWS // BATCH))


def cpu_s() -> float:
    """CPU seconds of this process so far, all its threads (not child processes)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def examples_per_s(fn, train_dir: str) -> tuple[float, float]:
    """(examples/s, CPU seconds per example) of one epoch of `fn`."""
    t, c = time.perf_counter(), cpu_s()
    n = fn(train_dir)
    return n / (time.perf_counter() - t), (cpu_s() - c) / n


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


RSS_GROWTH = """
import json, os, sys
from bench.loader_adapter import service_batches
def rss():  # resident bytes now
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
directory, batch, batches = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
before = rss()
peak = before
for b in service_batches(directory, batch, batches):  # sampled after each batch
    peak = max(peak, rss())
print(json.dumps((peak - before) / 2**20))
"""
RSS_PAIRS = 5


def rss_growth_mb(train_dir: str, batches: int) -> float:
    """Peak RSS growth (MB) of a fresh process, after its imports, over `batches` batches of
    the service's loader: the loader's own memory (threads, buffers, windows, and what the
    allocators keep of them)."""
    out = subprocess.run(
        [sys.executable, "-c", RSS_GROWTH, train_dir, str(BATCH), str(batches)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return float(out.stdout.split()[-1])


def peak_rss_ratio(base: str, big: str) -> dict:
    """Peak RSS growth over one epoch of the 10x data set / over as many batches (ten epochs) of
    the base one: the data size is all that differs. The allocators' retention grows with the
    number of windows read until it levels off, so one epoch of each (the figure's definition
    before issue 21, kept in raw as `one_epoch_each_ratio`) also counted the longer run's
    retention as growth with data size; `run_length_ratio` (ten base epochs / one) shows that
    part, and would show a loader whose memory grows with the steps it serves. `RSS_PAIRS`
    runs of each, interleaved; the value is the ratio of their medians (a run's peak moves by
    some MB with when its threads happen to hold their buffers together, not with the load),
    raw `ratio_spread` the interquartile range of the paired ratios."""
    batches = 10 * NUM_ROWS // BATCH
    big_mb, same_mb, epoch_mb = [], [], []
    for _ in range(RSS_PAIRS):
        big_mb.append(rss_growth_mb(big, batches))
        same_mb.append(rss_growth_mb(base, batches))
        epoch_mb.append(rss_growth_mb(base, NUM_ROWS // BATCH))
    ratios = paired(big_mb, same_mb)
    return figure(
        "loader_peak_rss_ratio",
        median(big_mb) / median(same_mb),
        base_rows=NUM_ROWS,
        big_rows=10 * NUM_ROWS,
        batches=batches,
        big_rss_growth_mb=median(big_mb),
        base_rss_growth_mb=median(same_mb),
        big_runs_mb=rounded(big_mb),
        base_same_batches_runs_mb=rounded(same_mb),
        base_one_epoch_runs_mb=rounded(epoch_mb),
        ratio_spread=ratios["spread"],
        one_epoch_each_ratio=median(big_mb) / median(epoch_mb),
        run_length_ratio=median(same_mb) / median(epoch_mb),
        big_data_mb=10 * NUM_ROWS * (64 * 4 + 16) / 2**20,
    )


def rates(base: str) -> dict:
    """Examples/s and CPU per example of the service's loader against pyarrow + numpy (`EPOCHS`
    epochs each; `REPEATS` pairs, the order alternating), then against DataLoader (one epoch;
    `DATALOADER_PAIRS` pairs, apart: its worker processes would load the cores the other runs
    share), and the ratio within each pair: the machine is shared, and a pair's two runs see
    about the same load where runs apart may not."""
    service, pyarrow = alternated(service_epochs, pyarrow_epochs, base, REPEATS)
    service_dl, dataloader = alternated(service_epochs, dataloader_epoch, base, DATALOADER_PAIRS)
    out = {
        "service": (median([r for r, _ in service]), median([c for _, c in service])),
        "pyarrow": (median([r for r, _ in pyarrow]), median([c for _, c in pyarrow])),
        "dataloader": (median([r for r, _ in dataloader]), median([c for _, c in dataloader])),
    }
    out["vs_pyarrow"] = paired([r for r, _ in service], [r for r, _ in pyarrow])
    out["cpu_vs_pyarrow"] = paired([c for _, c in service], [c for _, c in pyarrow])
    out["vs_dataloader"] = paired([r for r, _ in service_dl], [r for r, _ in dataloader])
    return out


def alternated(a, b, train_dir: str, pairs: int) -> tuple[list, list]:
    """`pairs` runs of `a` and of `b` (`examples_per_s` each), a pair's order alternating,
    after one untimed run of each: the first use in a process of a side's parts (pyarrow's
    dataset code and thread pool, the first torch ops, the collector's first sweeps over the
    objects they make) would go to the first pair only."""
    a(train_dir)
    b(train_dir)
    runs_a, runs_b = [], []
    for i in range(pairs):
        if i % 2:
            runs_b.append(examples_per_s(b, train_dir))
            runs_a.append(examples_per_s(a, train_dir))
        else:
            runs_a.append(examples_per_s(a, train_dir))
            runs_b.append(examples_per_s(b, train_dir))
    return runs_a, runs_b


def paired(num: list[float], den: list[float]) -> dict:
    """Ratios of paired measurements: their median, interquartile range (`spread`) and each."""
    ratios = [n / d for n, d in zip(num, den, strict=True)]
    q = statistics.quantiles(ratios, n=4, method="inclusive")
    spread = [round(q[0], 4), round(q[2], 4)]
    return {"median": median(ratios), "spread": spread, "pair_ratios": rounded(ratios)}


def median(values: list[float]) -> float:
    return float(np.median(values))


def rounded(values: list[float]) -> list[float]:
    return [round(v, 4) for v in values]


def run() -> dict:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="playbook-bench-data-") as tmp:
        base = write_digits_like(os.path.join(tmp, "base"), NUM_ROWS, NUM_FILES)
        r = rates(base)
        svc, pa_rate, dl_rate = r["service"][0], r["pyarrow"][0], r["dataloader"][0]
        results = {
            "loader_vs_pyarrow": figure(
                "loader_vs_pyarrow",
                r["vs_pyarrow"]["median"],
                service_examples_per_s=svc,
                pyarrow_examples_per_s=pa_rate,
                ratio_spread=r["vs_pyarrow"]["spread"],
                pair_ratios=r["vs_pyarrow"]["pair_ratios"],
                cpu_per_example_ratio=r["cpu_vs_pyarrow"]["median"],
                cpu_per_example_ratio_spread=r["cpu_vs_pyarrow"]["spread"],
                rows=NUM_ROWS,
                batch_size=BATCH,
                repeats=REPEATS,
                epochs_per_run=EPOCHS,
                load_avg_1m=os.getloadavg()[0],
            ),
            "loader_vs_dataloader": figure(
                "loader_vs_dataloader",
                r["vs_dataloader"]["median"],
                service_examples_per_s=svc,
                dataloader_examples_per_s=dl_rate,
                ratio_spread=r["vs_dataloader"]["spread"],
                num_workers=2,
            ),
        }
        # Heavy preprocessing in Python holds the GIL: a prefetch thread cannot run it beside
        # the step, worker processes can (the figure); the thread and no prefetch for reference.
        median_run = lambda runs: sorted(runs, key=lambda r: r["fraction"])[len(runs) // 2]  # noqa: E731
        workers = median_run([exposed_fraction(base, num_workers=WORKERS) for _ in range(EXPOSED_REPEATS)])
        thread = median_run([exposed_fraction(base) for _ in range(EXPOSED_REPEATS)])
        unfetched = median_run([exposed_fraction(base, prefetch_batches=0) for _ in range(EXPOSED_REPEATS)])
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
        results["loader_peak_rss_ratio"] = peak_rss_ratio(base, big)
    return results


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
