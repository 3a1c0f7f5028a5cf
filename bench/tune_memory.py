"""tune_memory: the memory Ray Tune holds per trial in the process that drives it (the study's
coordinator), for a round run as one Tune run against the same round run as consecutive Tune
runs of at most `PER_RUN` trials (what `Coordinator._run_round` does, `trials_per_tune_run`).

Each arm runs in its own process on its own local Ray cluster, with Tune set up as the
coordinator sets it up (no CSV/TensorBoard loggers, Ray's log-once set cleared after each run,
actors reused): TRIALS trivial function trials
(two reports of ~40 metrics and a summary, like a service trial's), 2 at once, actors reused so
that Tune's bookkeeping, not trial start-up, dominates. The driver's resident memory is sampled
at every trial completion (the samples the figure reads, `HELD_SAMPLES`, after a garbage
collection and glibc's `malloc_trim`); the figure is the growth per trial of what is held at
the end of each of the split round's runs over the same for the single run, each a Theil-Sen
slope (the median of the pairwise slopes) over the second half of the round.

Why the collection and the trim: without them the resident size also counts garbage cycles not
yet collected and memory the allocators keep after it is freed, up to a high-water mark that they
reach in steps, some MB at a time, at no fixed trial. In a split round of 720 such steps
(~3 MB, twice in the second half) put the figure at 0.107 and 0.213 in two of six `make bench`
runs (0.010-0.027 in the others); with both, three runs of both arms gave 0.026-0.029, the
split round's held memory rising smoothly by ~4.5 KB per trial. Why the second half and a
median slope: start-up allocations fill the first half, and one remaining step moves a median
of pairwise slopes little (fewer than half the pairs straddle it).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench.cluster import rss_bytes
from bench.common import ROOT, figure

TRIALS = 720
PER_RUN = 30
HELD_SAMPLES = 5
"""The completions up to each multiple of PER_RUN whose samples `held_at` reads: only they are
taken after `release_free_memory` (it collects the whole heap: at every completion it tripled
the suite's time)."""
CONCURRENCY = 2


def trainable(config):
    from ray import tune

    for step in (1, 2):
        tune.report({**{f"input/k{i}": float(i) for i in range(40)}, "validation/loss": 0.5, "step": step})
    tune.report({"summary": True, "validation/loss": 0.4, "best_checkpoint": "x" * 100})


def arm(trials: int, per_run: int) -> dict:
    """In a fresh process: the round as Tune runs of `per_run` trials; RSS per completion."""
    import ray
    from ray import tune
    from ray.tune.logger import JsonLoggerCallback
    from ray.util.debug import reset_log_once

    os.environ["TUNE_DISABLE_AUTO_CALLBACK_LOGGERS"] = "1"  # as the coordinator runs Tune
    samples: list[tuple[int, int]] = []

    class Sampler(tune.Callback):
        def on_trial_complete(self, iteration, trials, trial, **info):
            done = len(samples) + 1
            if is_read(done):
                release_free_memory()
            samples.append((done, rss_bytes(os.getpid())))

    configs = [
        {"trial_name": f"t{i:05d}", "hparams": {"learning_rate": 0.001 * (i + 1)}} for i in range(trials)
    ]
    ray.init(address="local", num_cpus=CONCURRENCY, include_dashboard=False, log_to_driver=False)
    t = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="playbook-bench-tune-") as tmp:
            for start in range(0, trials, per_run):
                tune.Tuner(
                    tune.with_resources(trainable, {"cpu": 1}),
                    param_space={"trial": tune.grid_search(configs[start : start + per_run])},
                    tune_config=tune.TuneConfig(max_concurrent_trials=CONCURRENCY, reuse_actors=True),
                    run_config=tune.RunConfig(
                        name="r", storage_path=tmp, verbose=0, callbacks=[Sampler(), JsonLoggerCallback()]
                    ),
                ).fit()
                reset_log_once()
    finally:
        ray.shutdown()
    return {"wall_s": time.perf_counter() - t, "samples": samples}


def is_read(done: int) -> bool:
    """Whether `held_at` reads the sample taken when `done` trials are done."""
    return -done % PER_RUN < HELD_SAMPLES


def release_free_memory() -> None:
    """Collect garbage cycles and hand glibc's free pages back to the system, so that the
    resident size sampled next is what the process holds (see the module docstring)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def held_at(samples: list[tuple[int, int]], sizes: list[int]) -> list[float]:
    """RSS when each size's trials are done: the median of the last `HELD_SAMPLES` completions up to it
    (single samples jitter by a few MB). For the split round these are the ends of its runs."""
    return [float(np.median([rss for _, rss in samples[max(0, n - HELD_SAMPLES) : n]])) for n in sizes]


def growth_per_trial(sizes: list[int], held: list[float]) -> float:
    """Theil-Sen slope over the second half: the median of the slopes between every two of
    its points. One step of the allocators' high-water mark in the first or last third of the
    span moves it little (fewer than half the pairs straddle it); steps that recur through the
    span read as growth, as they should."""
    half = len(sizes) // 2
    xs, ys = sizes[half:], held[half:]
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs))]
    return float(np.median(slopes))


def least_squares_growth(sizes: list[int], held: list[float]) -> float:
    """The least-squares slope over the same points (in raw, beside the figure)."""
    half = len(sizes) // 2
    return float(np.polyfit(sizes[half:], held[half:], 1)[0])


def run_arm(per_run: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "bench.tune_memory", str(TRIALS), str(per_run)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def run() -> dict:
    single, split = run_arm(TRIALS), run_arm(PER_RUN)
    sizes = list(range(PER_RUN, TRIALS + 1, PER_RUN))
    held = {name: held_at(a["samples"], sizes) for name, a in (("single", single), ("split", split))}
    per_trial = {name: growth_per_trial(sizes, h) for name, h in held.items()}
    least_squares = {name: least_squares_growth(sizes, h) / 1024 for name, h in held.items()}
    extra_runs = TRIALS // PER_RUN - 1
    return {
        "tune_memory": figure(
            "tune_memory",
            per_trial["split"] / per_trial["single"],
            trials=TRIALS,
            trials_per_run=PER_RUN,
            kb_per_trial_single_run=per_trial["single"] / 1024,
            kb_per_trial_split=per_trial["split"] / 1024,
            kb_per_trial_least_squares=least_squares,
            rss_mb_at={
                name: {n: round(v / 2**20, 1) for n, v in zip(sizes, h, strict=True)}
                for name, h in held.items()
            },
            wall_s_single=single["wall_s"],
            wall_s_split=split["wall_s"],
            s_per_extra_run=(split["wall_s"] - single["wall_s"]) / extra_runs,
        )
    }


if __name__ == "__main__":
    if len(sys.argv) == 3:
        print(json.dumps(arm(int(sys.argv[1]), int(sys.argv[2]))))
    else:
        print(json.dumps(run(), indent=1))
