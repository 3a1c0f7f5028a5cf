"""Shared helpers: medians over repeats, paired (interleaved) ratios, the figure record, the
single-trial study the step benchmarks run, and a synthetic digits-shaped dataset larger than
the bundled one (the bundled 1,257 training rows are gone in milliseconds)."""

from __future__ import annotations

import io
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The repository (the working directory of the benchmarks' own subprocesses)."""

GOALS = {
    # key: (comparison, goal, what the ratio is)
    "step_ratio": (
        ">=",
        0.95,
        "steps per CPU second of the service's trainer / a bare PyTorch loop (median of interleaved pairs)",
    ),
    "bf16_speedup": (
        "info",
        0,
        "steps per CPU second of the service's trainer with precision bf16 / fp32 (interleaved pairs)",
    ),
    "lm_step_ratio": (
        ">=",
        0.95,
        "tokens per CPU second of the service's trainer, lm workload / a bare PyTorch loop "
        "(interleaved pairs)",
    ),
    "loader_vs_pyarrow": (
        ">=",
        0.9,
        "loader examples/s / pyarrow.parquet.read_table + numpy (median of interleaved pairs of"
        " 10-epoch runs, after an untimed run of each)",
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
        "worker, prefetch) / a bare PyTorch loop over decoded tensors in memory (median of interleaved "
        "pairs)",
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
        "fixed cost per trial, a round of 20 two-worker trials (nothing set: reused workers) / a plain "
        "Tune function trial",
    ),
    "eval_interval_wait_s": (
        "<=",
        0.1,
        "seconds per evaluation of those two-worker trials between reports to Tune beyond their steps, "
        "eval and checkpoint (median; raw.ray_train_median_s: the same as Ray Train runs)",
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
    "fsdp_step_ratio": (
        ">=",
        0.95,
        "steps per CPU second (rank 0) of the service's FSDP trial, lm on 2 gloo ranks / a bare FSDP2 "
        "loop of the same model (interleaved pairs; raw.wall_ratio per wall second)",
    ),
    "fsdp_async_stall_vs_copy": (
        "<=",
        1.5,
        "loop stall of an async sharded save (state dicts + snapshot) / a plain copy of the rank's shards "
        "(the worst of 2 ranks)",
    ),
    "fsdp_memory_per_rank_ratio": (
        "<=",
        0.55,
        "a rank's bytes of parameters, gradients and optimizer state under fsdp / a DDP rank's, lm on 2 "
        "workers (the largest rank; 1/N + 0.05)",
    ),
    "fsdp_memory_per_rank_ratio_4_workers": (
        "<=",
        0.3,
        "the same on 4 workers (1/N + 0.05)",
    ),
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
        "Tune driver memory per trial (a TuneRun process's) with a round split into Tune runs / as one run "
        "(median slopes over the second half of a 720-trial round, resident size after gc and malloc_trim)",
    ),
    "ddp_bucket_per_param_cost": (
        "info",
        0,
        "steps/s of a CPU gloo DDP step with the service's buckets (wrap_ddp: one layout in every "
        "process, for bitwise resume) / DDP's default buckets; the lowest of images and digits models "
        "on 2 and 3 ranks; raw.per_param: one bucket per parameter / the default",
    ),
    # No goal in issue 11: "info" figures always pass; their numbers are in raw.
    "cluster": (
        "info",
        0.0,
        "fixed cost per trial (s) of a 1,000-trial study on the local cluster; raw: the study, "
        "the 4-node multi-host trial",
    ),
    "two_host_trial_fixed_s": (
        "<=",
        2.0,
        "fixed cost per trial (s) of a round of two-host x one-worker trials (pooled workers) on a "
        "simulated 8-node cluster, 4 at once: wall x concurrency / trials - the trial's step loop; raw: "
        "trials/s, coordinator and TuneRun RSS growth per trial, what is alive at the end",
    ),
}


def median_of(fn: Callable[[], float], repeats: int) -> tuple[float, list[float]]:
    values = [fn() for _ in range(repeats)]
    return statistics.median(values), values


Rates = dict[str, float]
"""A block's rates by name (e.g. "wall": steps per second, "cpu": steps per CPU second)."""


def paired_ratio(service: Callable[[], Rates], baseline: Callable[[], Rates], pairs: int) -> dict:
    """The service's rates over the baseline's, robust to background load on a shared machine:
    `pairs` short blocks of each, interleaved in one process (`paired_rates`), the ratio of each
    pair, and their median (`pair_stats`)."""
    return pair_stats(paired_rates(service, baseline, pairs))


def paired_rates(service: Callable[[], Rates], baseline: Callable[[], Rates], pairs: int) -> dict:
    """`pairs` blocks of each side, interleaved in this process (ABBA: the order alternates, so
    a trend in the load hits both sides alike): each side's rates per pair, and the host's
    1-minute load average before and after (on 2 CPUs, more than ~2 is other processes)."""
    load = [os.getloadavg()[0]]
    service_rates, baseline_rates = [], []
    for i in range(pairs):
        if i % 2:
            b, a = baseline(), service()
        else:
            a, b = service(), baseline()
        service_rates.append(a)
        baseline_rates.append(b)
    load.append(os.getloadavg()[0])
    return {"service": service_rates, "baseline": baseline_rates, "load_avg_1m": [round(x, 2) for x in load]}


def paired_in_processes(module: str, processes: int) -> dict:
    """`pair_stats` of the pairs that `processes` fresh processes measure one after the other
    (`python -m module --pairs` prints its `paired_rates`), pooled. A process's memory layout
    (address randomization, where the allocators put the hot tensors) favours one loop or the
    other by a point or two for all of its pairs; pooling the pairs of several processes
    averages that out, as more pairs in one process cannot."""
    parts = []
    for _ in range(processes):
        out = subprocess.run(
            [sys.executable, "-m", module, "--pairs"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        parts.append(json.loads(out.strip().splitlines()[-1]))
    pooled = {side: [r for p in parts for r in p[side]] for side in ("service", "baseline")}
    load = [parts[0]["load_avg_1m"][0], parts[-1]["load_avg_1m"][-1]]
    return {**pair_stats({**pooled, "load_avg_1m": load}), "processes": processes}


def pair_stats(rates: dict) -> dict:
    """Per rate name of `paired_rates`: `ratio` (the median of the pairs' ratios: each pair's
    two blocks ran moments apart, under about the same load), `spread` (their interquartile
    range), every pair ratio, and the sides' own medians."""
    service_rates, baseline_rates = rates["service"], rates["baseline"]
    out: dict = {"pairs": len(service_rates), "load_avg_1m": rates["load_avg_1m"]}
    for key in service_rates[0]:
        ratios = [a[key] / b[key] for a, b in zip(service_rates, baseline_rates, strict=True)]
        out[key] = {
            "ratio": statistics.median(ratios),
            "spread": quartiles(ratios),
            "pair_ratios": [round(r, 4) for r in ratios],
            "service": statistics.median(a[key] for a in service_rates),
            "baseline": statistics.median(b[key] for b in baseline_rates),
        }
    return out


def paired_raw(paired: dict, clock: str, unit: str) -> dict:
    """The raw figures of a `paired_ratio` whose value is its `clock` side ("cpu" or "wall"):
    that side's spread and pair ratios, the wall clock's beside them, and the unit the sides'
    rates are counted in (the performance table's "service / baseline" column)."""
    value, wall = paired[clock], paired["wall"]
    return {
        "baseline_unit": unit,
        "spread": value["spread"],
        "pair_ratios": value["pair_ratios"],
        "wall_ratio": round(wall["ratio"], 4),
        "wall_spread": wall["spread"],
        "wall_pair_ratios": wall["pair_ratios"],
        "pairs": paired["pairs"],
        "load_avg_1m": paired["load_avg_1m"],
    }


class CpuClock:
    """A `loop.BatchSource` wrapper that notes this process's CPU time (all its threads: the
    loop's, its prefetch and read threads') as each batch is handed to a step, so that the
    loop's steps can be counted per CPU second as well as per wall second."""

    def __init__(self, source):
        self.source, self.marks = source, []

    def __call__(self, stream, start_step: int):
        for batch in self.source(stream, start_step):
            self.marks.append(time.process_time())
            yield batch

    def steps_per_cpu_s(self) -> float:
        """From the first step's start to the last one's: all steps but the last."""
        return (len(self.marks) - 1) / (self.marks[-1] - self.marks[0])


def quartiles(values: list[float]) -> list[float]:
    """[25th, 75th] percentile."""
    q = statistics.quantiles(values, n=4, method="inclusive")
    return [round(q[0], 4), round(q[2], 4)]


class Discard:
    """A Reporter that keeps the eval rows only (no checkpoints; the loop's own measurement is in
    its rows)."""

    def __init__(self):
        self.rows = []

    def report(self, metrics, checkpoint_dir):
        self.rows.append(metrics)

    def restore(self):
        return None


def single_trial_study(
    name: str,
    workload: str,
    data_dir: str,
    storage: str,
    training: dict,
    learning_rate: float,
    input: dict | None = None,
    use_gpu: bool = False,
):
    """The study of one fixed trial (one round, the learning rate fixed) that the step benchmarks
    run: `training` holds max_train_steps, batch_size and the rest; eval_every_steps defaults to
    max_train_steps (one eval and checkpoint, after the timed steps), the optimizer to SGD with
    momentum, the schedule to a constant learning rate (what the bare loops do)."""
    from service.study import spec

    training = {
        "eval_every_steps": training["max_train_steps"],
        "optimizer": "sgd_momentum",
        "schedule": {"kind": "constant"},
        **training,
    }
    doc = {
        "name": name,
        "workload": workload,
        "data": {"train": f"{data_dir}/train", "validation": f"{data_dir}/validation"},
        "storage": storage,
        "scaling": {"use_gpu": use_gpu},
        "training": training,
        "search": {"learning_rate": {"role": "fixed", "value": learning_rate}},
        "rounds": [{"name": "r", "num_trials": 1}],
    }
    if input:
        doc["input"] = input
    return spec.load_dict(doc)


def run_trial(study, hparams: dict, device=None, batch_source=None) -> dict:
    """One trial of `study` through the service's step loop (trainer.loop.train, this process,
    no Ray): its last eval row (`steps_per_s` is the loop's own measurement of its steps) and,
    under `steps_per_cpu_s`, its steps per CPU second of this process (`CpuClock`)."""
    from service.distributed.topology import Topology
    from service.planning.trial import TrialPlan
    from service.trainer import loop

    steps = study.training.max_train_steps
    plan = TrialPlan(study, f"r-{time.monotonic_ns()}", "r", dict(hparams), steps)
    reporter = Discard()
    pin = device is not None and torch_device_type(device) == "cuda"
    clock = CpuClock(batch_source or loop.local_batches(study.input.prefetch_batches, pin))
    loop.train(plan, Topology(), reporter, device, batch_source=clock)
    return {**reporter.rows[-1], "steps_per_cpu_s": clock.steps_per_cpu_s()}


def torch_device_type(device) -> str:
    import torch

    return torch.device(device).type


def block_rates(steps: int, wall_start: float, cpu_start: float) -> Rates:
    """A bare block's rates, from its perf_counter and process_time at its start."""
    return {
        "wall": steps / (time.perf_counter() - wall_start),
        "cpu": steps / (time.process_time() - cpu_start),
    }


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _gloo_rank(rank: int, world: int, init_file: str, out: str, fn: Callable, args: tuple) -> None:
    import datetime
    import gc

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=300)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timeout
    )
    try:
        result = fn(rank, world, *args)
        gc.collect()  # DDP's reducers go before their process group, not at interpreter exit
        dist.barrier()  # and no rank tears its group down while another still talks to it
    finally:
        dist.destroy_process_group()
    torch.save(result, f"{out}-{rank}.pt")


def on_gloo_ranks(fn: Callable, world: int, root: str, *args) -> list:
    """`fn(rank, world, *args)` in `world` spawned processes joined in one gloo group (one torch
    thread each); each rank's result, by rank. `fn` must be a module-level function."""
    import torch
    import torch.multiprocessing as mp

    out = os.path.join(root, f"gloo-{world}-{time.monotonic_ns()}")
    mp.spawn(_gloo_rank, args=(world, out + ".init", out, fn, args), nprocs=world, join=True)
    return [torch.load(f"{out}-{r}.pt", weights_only=False) for r in range(world)]


def tensors_of(tree):
    """Every tensor in a tree of dicts, lists and tuples."""
    import torch

    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict | list | tuple):
        for v in tree.values() if isinstance(tree, dict) else tree:
            yield from tensors_of(v)


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
