"""two_host_round (issue 39): a round of two-host x one-worker trials at scale, through the real
path (`study_run.run_study`: the coordinator, TuneRun actors, pooled trials whose world rank 1
is a `PoolWorker` reused trial after trial), on a simulated cluster (`ray.cluster_utils.Cluster`:
a head with no CPUs, `NODES` nodes of one CPU each, so `NODES / 2` trials run at once).

Figure `two_host_trial_fixed_s`: wall time x concurrency / trials - the trial's own step loop
(from its metrics log, as `bench.trial_overhead.loop_seconds`). Raw: trials/s (overall, steady,
by quarter), the seconds between one Tune run's last trial and the next run's first, the
resident memory of the coordinator, of each TuneRun actor and of the trial processes sampled
against trials done with its least-squares growth per trial, and what Ray counts alive once
the study has returned (actors, placement groups, worker processes).

    python -m bench.two_host_round [--trials N]   (default: TWO_HOST_TRIALS env var, else 2,000)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from bench.cluster import Sampler, cluster_census, process_tree, raylet_pids, rss_bytes, slope, study_spec
from bench.common import figure
from bench.trial_overhead import ROOT, loop_seconds

TWO_HOST_TRIALS = 2000
NODES, STEPS = 8, 8
CONCURRENCY = NODES // 2  # each trial holds two 1-CPU nodes (STRICT_SPREAD: one worker per host)
SETTLE_S = 30.0  # how long the end census waits for the study's actors to go
ACTIVE_TUNE_RUN = "ray::TuneRun.fit"
TRIAL_PROCESSES = ("ray::ImplicitFunc", "ray::PoolWorker")
"""A trial's two ranks: its Tune trial's process (rank 0) and its pool's worker, reused trial after trial."""
STUDY_PROCESSES = ("ray::Coordinator", "ray::TuneRun", "ray::ImplicitFunc", "ray::PoolWorker")
"""The study's own processes (a Tune trial's is titled ray::ImplicitFunc); none should outlive it."""


def trials_wanted() -> int:
    """The round's trial count: the TWO_HOST_TRIALS environment variable, else the goal's."""
    text = os.environ.get("TWO_HOST_TRIALS", str(TWO_HOST_TRIALS))
    if not text.isdigit() or int(text) < 1:
        raise SystemExit(f"TWO_HOST_TRIALS={text!r}: a number of trials, at least 1")
    return int(text)


def sampler(cluster, trials_dir: str) -> Sampler:
    """Per sample: trials done (metrics log written), the coordinator's resident bytes and each
    TuneRun process's and each trial process's (by pid: a Tune run's actor ends with its run, its
    trial processes and pools too)."""
    raylets = raylet_pids(cluster.list_all_nodes())

    def sample():
        tree = process_tree(raylets)
        coordinator = [p for p, c in tree.items() if c.startswith("ray::Coordinator")]
        done = sum(os.path.exists(f"{trials_dir}/{t}/metrics.jsonl") for t in os.listdir(trials_dir))
        return {
            "t": time.perf_counter(),
            "done": done,
            "coordinator_rss": sum(rss_bytes(p) or 0 for p in coordinator),
            # The TuneRun running its Tune run (titled by its method; the spare is idle).
            "tune_run_rss": {p: rss_bytes(p) or 0 for p, c in tree.items() if c.startswith(ACTIVE_TUNE_RUN)},
            "trial_rss": {p: rss_bytes(p) or 0 for p, c in tree.items() if c.startswith(TRIAL_PROCESSES)},
        }

    return Sampler(sample, 0.5)


def growth(points: list[tuple[int, int]]) -> float:
    """Bytes per trial: the least-squares slope over the last three quarters of `points`
    (trials done, resident bytes), start-up allocations excluded."""
    if not points:
        return float("nan")
    lo, hi = points[0][0], points[-1][0]
    return slope([p for p in points if p[0] >= lo + (hi - lo) / 4])


def rate_by_quarter(samples: list[dict], trials: int) -> list[float]:
    """Trials done per second in each quarter of the round (by trials done): a per-trial cost
    that grows with the round shows as a falling rate."""
    marks = [next((x for x in samples if x["done"] >= trials * q / 4), None) for q in range(5)]
    marks[0] = samples[0]
    rates = []
    for a, b in zip(marks[:-1], marks[1:], strict=True):
        ok = a and b and b["t"] > a["t"]
        rates.append(round((b["done"] - a["done"]) / (b["t"] - a["t"]), 3) if ok else float("nan"))
    return rates


def run_size(trials: int) -> int:
    """Trials per Tune run, as the coordinator splits a round without `trials_per_tune_run`."""
    from service.orchestration.coordinator import MIN_TRIALS_PER_TUNE_RUN, TUNE_RUN_SLOT_TRIALS

    return min(trials, max(MIN_TRIALS_PER_TUNE_RUN, TUNE_RUN_SLOT_TRIALS * CONCURRENCY))


def memory(samples: list[dict], trials: int) -> dict:
    """The coordinator's resident memory against trials done, and each Tune run's: its
    `TuneRun` process while it runs the run (the next run's is started idle while one runs)."""
    coordinator = [(x["done"], x["coordinator_rss"]) for x in samples if x["coordinator_rss"]]
    by_pid: dict[int, list[tuple[int, int]]] = {}
    for x in samples:
        for pid, rss in x["tune_run_rss"].items():
            if rss:
                by_pid.setdefault(pid, []).append((x["done"], rss))
    size, mb = run_size(trials), 2**20
    runs = [
        {
            "trials_done": [p[0][0], p[-1][0]],
            "rss_first_mb": round(p[0][1] / mb, 1),
            "rss_last_mb": round(p[-1][1] / mb, 1),
            "rss_per_trial_kb": growth(p) / 1024,
        }
        for p in by_pid.values()
    ]
    by_quarter = [0.0] * 4
    for d, r in coordinator:
        q = min(4 * d // trials, 3)
        by_quarter[q] = max(by_quarter[q], round(r / mb, 1))
    return {
        "coordinator_rss_first_mb": coordinator[0][1] / mb if coordinator else float("nan"),
        "coordinator_rss_last_mb": coordinator[-1][1] / mb if coordinator else float("nan"),
        "coordinator_rss_peak_by_quarter_mb": by_quarter,
        "coordinator_rss_per_trial_kb": growth(coordinator) / 1024,
        "trials_per_tune_run": size,
        "tune_runs": runs,
        "tune_run_switch_s": switch_times(samples, trials, size),
        **trial_process_memory(samples),
    }


def trial_process_memory(samples: list[dict]) -> dict:
    """The trial processes (ranks 0 and 1, reused through a Tune run): the median over them of
    their resident memory's growth per trial of the round (each process runs 1/CONCURRENCY of
    them), over the processes that saw 50 trials or more, and the largest resident size seen."""
    by_pid: dict[int, list[tuple[int, int]]] = {}
    for x in samples:
        for pid, rss in x["trial_rss"].items():
            if rss:
                by_pid.setdefault(pid, []).append((x["done"], rss))
    long_lived = [p for p in by_pid.values() if p[-1][0] - p[0][0] >= 50]
    slopes = [growth(p) / 1024 for p in long_lived]
    return {
        "trial_processes_seen": len(by_pid),
        "trial_process_rss_max_mb": max((r for p in by_pid.values() for _, r in p), default=0) / 2**20,
        "trial_process_rss_per_trial_kb": statistics.median(slopes) if slopes else float("nan"),
    }


def switch_times(samples: list[dict], trials: int, size: int) -> list[float]:
    """Seconds from each Tune run's last trial done to the next run's first (the next run's
    start: its trial processes and their pools, started anew)."""
    out = []
    for b in range(size, trials, size):
        a = next((x["t"] for x in samples if x["done"] >= b), None)
        c = next((x["t"] for x in samples if x["done"] > b), None)
        out.append(round(c - a, 1) if a is not None and c is not None else float("nan"))
    return out


def settled_census(cluster) -> dict:
    """What Ray counts alive after the study returned, once its actors and their processes
    have gone (the coordinator is killed as `run_study` returns; a Tune run's trial actors and
    their pools end with the run), or as it stands after SETTLE_S."""
    t = time.perf_counter()
    while True:
        census = cluster_census(cluster)
        left = [title for title in census["processes"] if title in STUDY_PROCESSES]
        gone = not census["actors"] and not census["placement_group_bundles"] and not left
        if gone or time.perf_counter() - t > SETTLE_S:
            return {**census, "settle_s": round(time.perf_counter() - t, 1)}
        time.sleep(1.0)


def measure(tmp: str, trials: int) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from service.orchestration.study_run import run_study

    study = study_spec(
        f"{tmp}/data",
        f"{tmp}/studies",
        "bench-two-host",
        trials,
        STEPS,
        scaling={"num_hosts": 2, "workers_per_host": 1},
        concurrency=CONCURRENCY,
        trials_per_tune_run=0,  # the service's default run length
    )
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        for _ in range(NODES):
            cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, log_to_driver=False)
        os.makedirs(f"{study.study_uri}/trials", exist_ok=True)
        sampling = sampler(cluster, f"{study.study_uri}/trials")
        t = time.perf_counter()
        rows = run_study(study)
        wall_s = time.perf_counter() - t
        samples = sampling.stop()
        census = settled_census(cluster)
    finally:
        ray.shutdown()
        cluster.shutdown()
    finished = [r for r in rows if r.get("status") == "FINISHED"]
    loops = [loop_seconds(study, r["trial_name"]) for r in finished]
    loop_s = statistics.median(loops) if loops else float("nan")
    per_trial_s = wall_s * CONCURRENCY / trials
    quarter = next((x for x in samples if x["done"] >= trials // 4), samples[0])
    last = samples[-1]
    steady = (last["done"] - quarter["done"]) / max(last["t"] - quarter["t"], 1e-9)
    return {
        "trials": trials,
        "trials_finished": len(finished),
        "statuses": sorted({str(r.get("status")) for r in rows}),
        "nodes": NODES,
        "concurrency": CONCURRENCY,
        "steps_per_trial": STEPS,
        "wall_s": wall_s,
        "trials_per_s": trials / wall_s,
        "trials_per_s_steady": steady,
        "trials_per_s_by_quarter": rate_by_quarter(samples, trials),
        "first_trial_done_s": next((x["t"] - t for x in samples if x["done"]), float("nan")),
        "wall_per_trial_x_concurrency_s": per_trial_s,
        "step_loop_s_per_trial": loop_s,
        "fixed_cost_per_trial_s": per_trial_s - loop_s,
        # The same at the steady rate (start-up excluded: the first Tune run and its pools).
        "fixed_cost_per_trial_steady_s": CONCURRENCY / steady - loop_s if steady else float("nan"),
        **memory(samples, trials),
        "alive_at_end": census,
    }


def run(trials: int | None = None) -> dict:
    from service.data.builtin import write_digits

    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory(prefix="playbook-bench-two-host-") as tmp:
        write_digits(f"{tmp}/data")
        raw = measure(tmp, trials or trials_wanted())
    return {"two_host_trial_fixed_s": figure("two_host_trial_fixed_s", raw["fixed_cost_per_trial_s"], **raw)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, help="trials in the round (default: $TWO_HOST_TRIALS, else 2,000)")
    args = p.parse_args(argv)
    if args.trials is not None and args.trials < 1:
        p.error("--trials must be at least 1")
    print(json.dumps(run(args.trials), indent=1))


if __name__ == "__main__":
    main()
