"""Shared helpers: medians over repeats, the figure record, and a synthetic digits-shaped dataset
larger than the bundled one (the bundled 1,257 training rows are gone in milliseconds)."""

from __future__ import annotations

import io
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

GOALS = {
    # key: (comparison, goal, what the ratio is)
    "step_ratio": (">=", 0.95, "steps/s of the service's trainer / a bare PyTorch loop"),
    "bf16_speedup": ("info", 0, "steps/s of the service's trainer with precision bf16 / fp32, same run"),
    "lm_step_ratio": (">=", 0.95, "tokens/s of the service's trainer, lm workload / a bare PyTorch loop"),
    "loader_vs_pyarrow": (
        ">=",
        0.9,
        "loader examples/s / pyarrow.parquet.read_table + numpy (median of interleaved pairs)",
    ),
    "loader_vs_dataloader": (">=", 1.0, "loader examples/s / torch DataLoader(num_workers=2)"),
    "exposed_input_fraction": (
        "<",
        0.05,
        "share of step time spent waiting for input (CPU-heavy preprocessing)",
    ),
    "cnn_step_ratio": (
        ">=",
        0.9,
        "images/s of the service's trainer, images workload (PNG decoded + augmented online, an input "
        "worker, prefetch) / a bare PyTorch loop over decoded tensors in memory",
    ),
    "cnn_exposed_input_fraction": (
        "<",
        0.05,
        "share of the images workload's step time spent waiting for input (one input worker process)",
    ),
    "trial_overhead_ratio": ("<=", 1.5, "fixed per-trial overhead / a plain Ray Tune function trial"),
    "multiworker_trial_overhead_ratio": (
        "<=",
        2.0,
        "fixed cost per trial, a round of 20 two-worker trials (reused) / a plain Tune function trial",
    ),
    "checkpoint_ratio": ("<=", 1.1, "checkpoint save / torch.save of the same state, same filesystem"),
    "async_checkpoint_stall_ratio": (
        "info",
        0,
        "loop stall with async save / a sync save (informational since issue 21: the stall is a memory "
        "copy of the state, so this is a copy against the disk's write speed; on a quiet machine a "
        "plain copy alone is above 0.1 of a sync save, raw.copy_vs_sync_save; the goal is "
        "async_stall_vs_copy)",
    ),
    "async_stall_vs_copy": ("<=", 1.5, "loop stall with async save / a plain copy of the state's tensors"),
    "loader_peak_rss_ratio": (
        "<=",
        1.2,
        "loader peak RSS growth over an epoch of a 10x dataset / over as many batches (ten epochs) of "
        "the base one (the same run length since issue 21: the allocators' retention grows with the "
        "windows read, not the data size; raw.one_epoch_each_ratio is the earlier one-epoch-each figure)",
    ),
    "demo_wall_s": ("<", 300.0, "`make demo` wall time in seconds (setup excluded)"),
    "scale": (
        "<",
        1.0,
        "planning at the top size (s): 100,000 trials' points, 100,000 files over 1,024 hosts",
    ),
    "coordinator_memory": (
        "<",
        1.0,
        "coordinator resident growth per trial beyond its rows (KB), second half of a 15,000-trial study",
    ),
    "tune_memory": (
        "<=",
        0.1,
        "Tune driver memory per trial (a TuneRun process's) with a round split into Tune runs / as one run",
    ),
    # No goal in issue 11: "info" figures always pass; their numbers are in raw.
    "cluster": (
        "info",
        0.0,
        "fixed cost per trial (s) of a 1,000-trial study on the local cluster; raw: the study, "
        "the 4-node multi-host trial",
    ),
}


def median_of(fn: Callable[[], float], repeats: int) -> tuple[float, list[float]]:
    values = [fn() for _ in range(repeats)]
    return statistics.median(values), values


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def figure(key: str, value: float, **raw) -> dict:
    """One results.json entry: the value, its goal and pass/fail, and the raw figures."""
    op, goal, what = GOALS[key]
    if op == "info":  # measured and reported, nothing to meet
        return {"value": round(value, 4), "goal": "informational", "pass": True, "what": what, "raw": raw}
    ok = {">=": value >= goal, "<=": value <= goal, "<": value < goal}[op]
    return {"value": round(value, 4), "goal": f"{op} {goal:g}", "pass": bool(ok), "what": what, "raw": raw}


def write_digits_like(root: str, num_rows: int, num_files: int, seed: int = 0) -> str:
    """`num_rows` rows shaped like the digits data (example_id, pixels: 64 floats, label) in
    `num_files` parquet files under root/train; returns that directory."""
    rng = np.random.default_rng(seed)
    out = os.path.join(root, "train")
    os.makedirs(out, exist_ok=True)
    for j, rows in enumerate(np.array_split(np.arange(num_rows), num_files)):
        pixels = rng.random((len(rows), 64), dtype=np.float32)
        table = pa.table(
            {
                "example_id": pa.array(rows.astype(np.int64)),
                "pixels": pa.FixedSizeListArray.from_arrays(pa.array(pixels.reshape(-1)), 64),
                "label": pa.array(rng.integers(0, 10, len(rows)).astype(np.int64)),
            }
        )
        buf = io.BytesIO()
        pq.write_table(table, buf, row_group_size=8192)
        with open(os.path.join(out, f"part-{j:05d}.parquet"), "wb") as f:
            f.write(buf.getvalue())
    return out
