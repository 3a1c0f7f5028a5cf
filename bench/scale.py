"""scale: how the service's own costs grow with trials, files and hosts, measured without a Ray
cluster through the real code paths with synthetic rows.

* planning: a quasi-random round's trial configs (`rounds.plan_round`) for 10 ... 100,000 trials;
  one rank's training shard (`sharding.train_shard`: files -> hosts, then its row ranges) for
  100 ... 100,000 files over 2 ... 1,024 hosts.
* bookkeeping, 10 ... 10,000 trials: a whole study's trial events through the coordinator's
  handler of them (`TrialEvents`: rows, the trial table's coalesced writes, the study-index row);
  one trial-table write; one study-index update (`study_index.record_study`); the round's
  verdicts (`report_lines.round_verdicts`); the report (`report.load` + `report.write`, what
  `playbook report` runs).
* memory: what the recording above leaves allocated (tracemalloc) -- the coordinator's
  per-study state -- against the number of trials, and against the reports per trial.

Each curve is fitted on log-log axes: the slope between consecutive sizes and a least-squares
slope over all of them (about 0: O(1); about 1: O(n); clearly above 1: worse than linear). The
slope between the two largest sizes says how a cost grows once fixed costs no longer hide it.
The figure `scale` is the largest such top slope over the curves (goal: <= 1.25, linear with
room for n log n and noise).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import random
import statistics
import tempfile
import time
import tracemalloc

from bench.common import figure
from service import report
from service.analysis.report_lines import round_verdicts
from service.data.files import DataFile
from service.data.sharding import train_shard
from service.orchestration.study_metrics import StudyMetrics
from service.planning.rounds import plan_round
from service.planning.trial import TrialPlan
from service.study import spec
from service.tracking import observe, study_index, trial_table
from service.tracking.trial_events import TrialEvents

PLAN_TRIALS = (10, 100, 1_000, 10_000, 100_000)
FILES = (100, 1_000, 10_000, 100_000, 300_000)
PLAN_FILES = 100_000  # the goal's top size; 300,000 shows the per-file cost levelling off
HOSTS = (2, 32, 1_024)
WORKERS_PER_HOST = 8
TRIALS = (10, 100, 1_000, 10_000)
REPORTS_PER_TRIAL = 5
INDEX_STUDIES = (10, 100, 1_000)  # studies sharing one storage root
MEMORY_TRIALS = (100, 1_000, 10_000)
MEMORY_REPORTS = (1, 10, 100, 1_000)  # at MEMORY_REPORTS_AT trials
MEMORY_REPORTS_AT = 100
EVALS_PER_TRIAL = 10  # rows of each synthetic metrics.jsonl the report reads
PLANNING_GOAL_S = 1.0
STUDY = {
    "name": "scale",
    "workload": "digits",
    "data": {"train": "/data/train", "validation": "/data/validation"},
    "training": {"max_train_steps": 1000, "batch_size": 32, "eval_every_steps": 200},
    "search": {
        "learning_rate": {"role": "nuisance", "min": 1e-4, "max": 1.0, "scale": "log"},
        "momentum": {"role": "nuisance", "min": 0.5, "max": 0.99},
        "weight_decay": {"role": "nuisance", "min": 1e-6, "max": 1e-2, "scale": "log"},
        "width": {"role": "scientific", "type": "choice", "values": [8, 16, 32]},
    },
    "rounds": [{"name": "explore", "num_trials": 10}],
}


def repeats(n: int) -> int:
    return 5 if n <= 1_000 else 3


def median_s(fn, n: int, reps: int | None = None) -> float:
    times = []
    for _ in range(reps or repeats(n)):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def fit(sizes, values, unit: str = "s") -> dict:
    """Log-log slopes of `values` against `sizes`, and the cost per item at the largest size."""
    xs = [math.log(n) for n in sizes]
    ys = [math.log(max(v, 1e-9)) for v in values]
    slopes = [(ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i]) for i in range(len(xs) - 1)]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    overall = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    top = slopes[-1]
    growth = "O(1)" if top < 0.3 else "O(n)" if top <= 1.25 else "worse than O(n)"
    return {
        "sizes": list(sizes),
        unit: [float(f"{v:.4g}") for v in values],
        "slopes": [round(s, 2) for s in slopes],
        "overall_slope": round(overall, 2),
        "top_slope": round(top, 2),
        "growth": growth,
        f"{unit}_per_item_at_top": float(f"{values[-1] / sizes[-1]:.4g}"),
    }


def make_study(storage: str, name: str, num_trials: int = 10) -> spec.Study:
    raw = {**STUDY, "name": name, "storage": storage}
    raw["rounds"] = [{"name": "explore", "num_trials": num_trials}]
    return spec.load_dict(raw)


# ----------------------------------------------------------------------------- planning


def planning() -> dict:
    study = make_study("/tmp/unused", "plan")
    rnd = study.rounds[0]
    seconds = []
    for n in PLAN_TRIALS:
        sized = dataclasses.replace(rnd, num_trials=n)
        seconds.append(median_s(lambda sized=sized: plan_round(study, sized, []), n))
    return fit(PLAN_TRIALS, seconds)


def sharding() -> dict:
    """What each rank plans at start: the whole files -> hosts assignment, then its row ranges
    (the assignment reads the file records once, in list order: visiting them in row-count
    order missed the cache past ~10,000 files)."""
    rng = random.Random(0)
    grid = {}
    for num_files in FILES:
        files = [
            DataFile(f"gs://bucket/train/part-{i:06d}.parquet", rng.randint(1_000, 2_000))
            for i in range(num_files)
        ]
        for hosts in HOSTS:
            if hosts <= num_files:
                grid[num_files, hosts] = median_s(
                    lambda files=files, hosts=hosts: train_shard(
                        files, hosts, hosts - 1, WORKERS_PER_HOST, 0
                    ),
                    num_files,
                )
    by_files = {}
    for h in HOSTS:
        sizes = [f for f in FILES if (f, h) in grid]
        by_files[f"{h}_hosts"] = fit(sizes, [grid[f, h] for f in sizes])
    return {
        "by_files": by_files,
        f"by_hosts_at_{PLAN_FILES}_files": fit(HOSTS, [grid[PLAN_FILES, h] for h in HOSTS]),
        "max_s_at_goal_size": max(grid[PLAN_FILES, h] for h in HOSTS),
    }


# ----------------------------------------------------------------------------- bookkeeping


def record_study(study: spec.Study, reports: int, seed: int = 0) -> TrialEvents:
    """The coordinator's bookkeeping of a whole round, events back to back: plan the round,
    PENDING rows and a write (as `Coordinator._run_round`), then per trial the Tune events
    (start, `reports` evaluation reports, the summary, complete), then the final write. The
    progress lines it prints go to /dev/null. Returns the coordinator's per-study state: the
    `TrialEvents`, with the trial table and the observers (progress limiter, metrics)."""
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        return _record_study(study, reports, seed)


def _record_study(study: spec.Study, reports: int, seed: int) -> TrialEvents:
    rng = random.Random(seed)
    observers = observe.StudyObservers.for_study(study, StudyMetrics(study.name, study.training.mode))
    table = trial_table.TrialTable(
        study.study_uri, study.training.metric, study.training.mode, observers.rows_changed
    )
    metric = study.training.metric
    events = TrialEvents(table, observers, metric)
    rnd = study.rounds[0]
    configs = plan_round(study, rnd, [])
    for c in configs:
        table.update(
            c["trial_name"],
            round=rnd.name,
            status="PENDING",
            max_train_steps=c["max_train_steps"],
            **{f"hp/{k}": v for k, v in c["hparams"].items()},
        )
    table.save()
    steps = study.round_steps(rnd)
    for c in configs:
        trial = {"trial_name": c["trial_name"], "max_train_steps": steps}
        events.started(trial)
        best = math.inf
        for i in range(1, reports + 1):
            value = rng.random()
            best = min(best, value)
            result = {
                "step": steps * i // reports,
                metric: value,
                "train/loss": rng.random(),
                "steps_per_s": 100.0,
            }
            events.result(trial, result)
        summary = {
            "summary": True,
            "status": "finished",
            "last_step": steps,
            metric: best,
            "best_step": steps // 2,
            "best_checkpoint": f"{study.study_uri}/trials/{c['trial_name']}/ckpt",
        }
        events.result(trial, summary)
        events.complete(trial)
    table.save()
    observers.rows_changed(table.snapshot(), state="finished")
    observers.metrics.stop()
    return events


def write_metrics_logs(study: spec.Study, rows: list[dict], seed: int = 0) -> None:
    """What each trial's rank 0 writes during training: EVALS_PER_TRIAL evaluations."""
    rng = random.Random(seed)
    steps = study.training.max_train_steps
    for row in rows:
        uri = TrialPlan(study, row["trial_name"], row["round"]).metrics_uri
        os.makedirs(os.path.dirname(uri), exist_ok=True)
        evals = [
            {
                "step": steps * (i + 1) // EVALS_PER_TRIAL,
                "train/loss": rng.random(),
                study.training.metric: rng.random(),
            }
            for i in range(EVALS_PER_TRIAL)
        ]
        with open(uri, "w") as f:
            f.write("".join(json.dumps(e) + "\n" for e in evals))


def bookkeeping_at(root: str, n: int) -> dict[str, float]:
    """Seconds of each bookkeeping step for a study of n trials."""
    study = make_study(os.path.join(root, f"n{n}"), f"scale-{n}", n)
    out = {"record_study": median_s(lambda: record_study(study, REPORTS_PER_TRIAL), n)}
    table = record_study(study, REPORTS_PER_TRIAL).table
    rows = table.snapshot()
    out["table_write"] = median_s(table.save, n)
    out["index_update"] = median_s(lambda: study_index.record_study(study, rows, "running", None), n)
    out["verdicts"] = median_s(lambda: round_verdicts(study, "explore", rows), n)
    # what `playbook report` reads: the stored study file, rows, verdicts and metrics logs
    with open(os.path.join(study.study_uri, "study.yaml"), "w") as f:
        f.write(spec.dump_yaml(study))
    with open(os.path.join(study.study_uri, "verdicts.json"), "w") as f:
        json.dump([round_verdicts(study, "explore", rows)], f)
    write_metrics_logs(study, rows)
    reps = 3 if n <= 1_000 else 1
    out["report_load"] = median_s(lambda: report.load(study.study_uri), n, reps)
    data = report.load(study.study_uri)
    out["report_write"] = median_s(lambda: report.write(data), n, reps)
    return out


def bookkeeping(root: str) -> dict:
    _warm_up_report(root)
    per_size = [bookkeeping_at(root, n) for n in TRIALS]
    curves = {k: fit(TRIALS, [m[k] for m in per_size]) for k in per_size[0]}
    curves["record_study"]["note"] = (
        f"a whole round's coordinator bookkeeping, {REPORTS_PER_TRIAL} reports per trial, events back to back"
    )
    curves["table_write"]["note"] = "one write at n rows; coalesced to <= 10% of the time and <= 1 per second"
    curves["index_update"]["note"] = (
        "the study's row from n trial rows to its index object, at each table write"
    )
    curves["report_write"]["note"] = "build (5 plots, the trial table) + write of report.html"
    return curves


def index_compile(root: str) -> dict:
    """One compile of a storage root's study table (list `_index/`, read every study's object,
    write studies.parquet and .csv, list again) against the studies in the root: O(studies),
    which is why a running study compiles at most every `observe.COMPILE_MIN_INTERVAL_S`."""
    times = []
    for n in INDEX_STUDIES:
        r = os.path.join(root, f"index-{n}")
        for i in range(n):
            name = f"study-{i:05d}"
            rows = [{"trial_name": "t", "status": "FINISHED", "best_metric": random.random()}]
            row = study_index.study_row(name, f"{r}/{name}", "", "loss", "min", rows, None, "running")
            study_index.write_row(r, row)
        times.append(median_s(lambda r=r: study_index.compile_table(r), n))
    curve = fit(INDEX_STUDIES, times)
    curve["note"] = "studies in the root, local disk; a running study compiles at most every 10 s"
    return curve


def _warm_up_report(root: str) -> None:
    """matplotlib's first figure pays for its imports and font cache: not a per-trial cost."""
    study = make_study(os.path.join(root, "warm"), "warm", 10)
    rows = record_study(study, 2).table.snapshot()
    with open(os.path.join(study.study_uri, "study.yaml"), "w") as f:
        f.write(spec.dump_yaml(study))
    write_metrics_logs(study, rows)
    report.write(report.load(study.study_uri))


# ----------------------------------------------------------------------------- memory


def held_bytes(root: str, trials: int, reports: int) -> int:
    """Bytes still allocated after recording a round: the coordinator's per-study state (the
    trial table, the progress limiter, the metrics' per-trial rates)."""
    study = make_study(os.path.join(root, f"mem-{trials}-{reports}"), f"mem-{trials}-{reports}", trials)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    state = record_study(study, reports)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del state
    return held


def memory(root: str) -> dict:
    held_bytes(root, 10, 2)  # warm up: lazy imports and caches are not per-study state
    by_trials = fit(
        MEMORY_TRIALS, [held_bytes(root, n, REPORTS_PER_TRIAL) for n in MEMORY_TRIALS], unit="bytes"
    )
    by_reports = fit(
        MEMORY_REPORTS, [held_bytes(root, MEMORY_REPORTS_AT, k) for k in MEMORY_REPORTS], unit="bytes"
    )
    by_reports["note"] = f"{MEMORY_REPORTS_AT} trials; flat = no per-report history held"
    return {"by_trials": by_trials, "by_reports_per_trial": by_reports}


# ----------------------------------------------------------------------------- all


def run() -> dict:
    with tempfile.TemporaryDirectory(prefix="playbook-bench-scale-") as root:
        curves = {
            "planning_trials": planning(),
            "sharding": sharding(),
            "bookkeeping": bookkeeping(root),
            "index_compile_by_studies": index_compile(root),
            "memory": memory(root),
        }
    linear = [
        curves["planning_trials"],
        *curves["sharding"]["by_files"].values(),
        *curves["bookkeeping"].values(),
        curves["index_compile_by_studies"],
        curves["memory"]["by_trials"],
    ]
    worst = max(c["top_slope"] for c in linear)
    planning_top_s = max(curves["planning_trials"]["s"][-1], curves["sharding"]["max_s_at_goal_size"])
    return {
        "scale": figure(
            "scale",
            planning_top_s,  # the goal; the growth slopes are in raw and the table
            largest_slope=worst,
            planning_goal_s=PLANNING_GOAL_S,
            memory_per_report_slope=curves["memory"]["by_reports_per_trial"]["top_slope"],
            **curves,
        )
    }


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
