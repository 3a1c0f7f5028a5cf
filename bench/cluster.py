"""cluster: the two measurements of issue 11 that need Ray (informational: no goal given).

* study: a real quasi-random round of `STUDY_TRIALS` tiny one-worker trials (digits, the fast
  path) through `study_run.run_study` on a local 2-CPU cluster, concurrency = cores. Wall time,
  trials/s, the fixed cost per trial (wall x concurrency / trials - the trial's own step loop,
  from its metrics log), and the coordinator's share: the CPU time of its actor process (which
  also runs Tune's driver loop), read from /proc.
* multihost: one trial on a simulated 4-node cluster (`ray.cluster_utils.Cluster`, 4 hosts x 1
  worker) through `launch.run_single`. Per-step time and the per-step cost of the multi-host
  guarantees, from rank 0's metrics log (`multihost/reduce_s`, `multihost/bn_sync_s`, timed in
  the loop), the cost of the rank-0 gate itself, and what the trial creates (actors, placement
  groups, Ray worker processes), sampled while it runs.
* two_host_round (issue 39, its own module): a round of `TWO_HOST_TRIALS` two-host pooled trials
  on a simulated 8-node cluster; its own figure, `two_host_trial_fixed_s`.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import threading
import time
import timeit

from bench.common import figure
from bench.trial_overhead import ROOT, loop_seconds

STUDY_TRIALS, STUDY_STEPS, STUDY_CONCURRENCY = 1000, 8, 2
STUDY_TRIALS_PER_TUNE_RUN = 100  # so that the round is 10 Tune runs (the default is >= 512)
MH_HOSTS, MH_STEPS, MH_EVERY = 4, 200, 50


def cpu_s(pid: int) -> float | None:
    """utime + stime of a process, from /proc (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int | None:
    """Resident bytes of a process, from /proc (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return None


def rss_growth_per_trial(samples: list[dict]) -> float:
    """Least-squares slope of the coordinator's resident bytes against trials done (samples
    from the first quarter of the study on: start-up allocations excluded)."""
    start = STUDY_TRIALS // 4
    return slope([(x["done"], x["rss_bytes"]) for x in samples if x["rss_bytes"] and x["done"] >= start])


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y against x over `points` (x, y); nan without two distinct x."""
    if len(points) < 2:
        return float("nan")
    mx = statistics.fmean(d for d, _ in points)
    my = statistics.fmean(r for _, r in points)
    var = sum((d - mx) ** 2 for d, _ in points)
    return sum((d - mx) * (r - my) for d, r in points) / var if var else float("nan")


def rss_peak_by_run(samples: list[dict]) -> list[float]:
    """The coordinator's peak resident bytes during each of the round's Tune runs (samples
    binned by trials done). Tune frees its per-trial state when a run ends, so the peaks of
    a coordinator that holds nothing more per trial than its rows stay level."""
    runs = math.ceil(STUDY_TRIALS / STUDY_TRIALS_PER_TUNE_RUN)
    peaks = [0.0] * runs
    for x in samples:
        k = min(x["done"] // STUDY_TRIALS_PER_TUNE_RUN, runs - 1)
        peaks[k] = max(peaks[k], float(x["rss_bytes"] or 0))
    return peaks


def process_tree(root_pids: list[int]) -> dict[int, str]:
    """pid -> command line of every descendant of `root_pids` (Ray workers are the raylets'
    children; their command line is their `ray::...` title)."""
    parent, cmd = {}, {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd[int(d)] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
    found, frontier = {}, set(root_pids)
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier and p not in found}
        found.update({p: cmd.get(p, "") for p in frontier})
    return found


def raylet_pids(nodes) -> list[int]:
    return [p.process.pid for n in nodes for p in n.all_processes.get("raylet", [])]


class Sampler:
    """Calls `sample()` every `interval_s` on a thread until stopped, and once more then; keeps
    every result."""

    def __init__(self, sample, interval_s: float):
        self.samples, self._sample, self._stop = [], sample, threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def _run(self, interval_s):
        while not self._stop.wait(interval_s):
            self._take()

    def _take(self):
        try:
            self.samples.append(self._sample())
        except Exception as e:  # a sample racing a process's exit: skip it
            self.samples.append({"error": repr(e)})

    def stop(self) -> list:
        """Stop, take a last sample (what the measured work left at its end), return them all."""
        self._stop.set()
        self._thread.join()
        self._take()
        return [s for s in self.samples if "error" not in s]


def study_spec(
    data: str,
    storage: str,
    name: str,
    num_trials: int,
    steps: int,
    scaling: dict | None = None,
    concurrency: int = STUDY_CONCURRENCY,
    trials_per_tune_run: int = STUDY_TRIALS_PER_TUNE_RUN,
):
    from service.study import spec

    return spec.load_dict(
        {
            "name": name,
            "workload": "digits",
            "data": {s: f"{data}/{s}" for s in ("train", "validation")},
            "storage": storage,
            **({"scaling": scaling} if scaling else {}),
            "training": {
                "max_train_steps": steps,
                "batch_size": 32,
                "eval_batch_size": 256,
                "eval_every_steps": steps if num_trials > 1 else MH_EVERY,
                "num_checkpoints_to_keep": 1,
                "optimizer": "sgd_momentum",
                "schedule": {"kind": "constant"},
            },
            "search": {
                "learning_rate": {
                    "role": "nuisance",
                    "type": "float",
                    "min": 0.01,
                    "max": 0.5,
                    "scale": "log",
                },
                "momentum": {"role": "nuisance", "type": "float", "min": 0.5, "max": 0.95},
                "width": {"role": "fixed", "value": 4},
            },
            "rounds": [
                {
                    "name": "r",
                    "num_trials": num_trials,
                    "max_concurrent_trials": concurrency,
                    "trials_per_tune_run": trials_per_tune_run,
                }
            ],
        }
    )


def coordinator_cpu_sampler(trials_dir: str) -> Sampler:
    """The study's driving processes, sampled: the coordinator actor (the raylet child titled
    `ray::Coordinator`) and the `ray::TuneRun` actor of each Tune run (Tune's driver loop), which
    ends with its run. Per sample: each process's CPU time so far (a process's last sample is
    its total), resident bytes, and how many trials have written their metrics log by then."""
    import ray

    raylets = raylet_pids([ray._private.worker._global_node])

    def sample():
        tree = process_tree(raylets)
        coordinator = [p for p, c in tree.items() if c.startswith("ray::Coordinator")]
        tune_runs = [p for p, c in tree.items() if c.startswith("ray::TuneRun")]
        done = sum(os.path.exists(f"{trials_dir}/{t}/metrics.jsonl") for t in os.listdir(trials_dir))
        return {
            "pids": coordinator,
            "cpu_s": sum(cpu_s(p) or 0.0 for p in coordinator),
            "tune_run_cpu_s": {p: cpu_s(p) or 0.0 for p in tune_runs},
            "rss_bytes": sum(rss_bytes(p) or 0 for p in coordinator),
            "tune_run_rss_bytes": sum(rss_bytes(p) or 0 for p in tune_runs),
            "t": time.perf_counter(),
            "done": done,
        }

    return Sampler(sample, 0.5)


def tune_run_cpu(samples: list[dict]) -> tuple[float, int]:
    """CPU seconds of every TuneRun process seen (each at its last sample) and how many."""
    last: dict[int, float] = {}
    for x in samples:
        last.update(x["tune_run_cpu_s"])
    return sum(last.values()), len(last)


def measure_study(tmp: str) -> dict:
    import ray

    from service.orchestration.study_run import run_study

    data = f"{tmp}/data"
    study = study_spec(data, f"{tmp}/studies", "bench-cluster", STUDY_TRIALS, STUDY_STEPS)
    ray.init(address="local", num_cpus=STUDY_CONCURRENCY, include_dashboard=False, log_to_driver=False)
    try:
        os.makedirs(f"{study.study_uri}/trials", exist_ok=True)
        sampler = coordinator_cpu_sampler(f"{study.study_uri}/trials")
        t = time.perf_counter()
        rows = run_study(study)
        wall_s = time.perf_counter() - t
        samples = sampler.stop()
    finally:
        ray.shutdown()
    finished = [r for r in rows if r.get("status") == "FINISHED"]
    # Steady state: from the first quarter of the trials done to the last sample.
    quarter = next((x for x in samples if x["done"] >= STUDY_TRIALS // 4), samples[0])
    last = samples[-1]
    steady = (last["done"] - quarter["done"]) / max(last["t"] - quarter["t"], 1e-9)
    loops = [loop_seconds(study, r["trial_name"]) for r in finished]
    loop_s = statistics.median(loops) if loops else float("nan")
    coordinator_cpu = max((s["cpu_s"] for s in samples), default=float("nan"))
    tune_cpu, tune_runs = tune_run_cpu(samples)
    driving_cpu = coordinator_cpu + tune_cpu
    per_trial_s = wall_s * STUDY_CONCURRENCY / STUDY_TRIALS
    return {
        "trials": STUDY_TRIALS,
        "trials_finished": len(finished),
        "statuses": sorted({str(r.get("status")) for r in rows}),
        "concurrency": STUDY_CONCURRENCY,
        "steps_per_trial": STUDY_STEPS,
        "wall_s": wall_s,
        "trials_per_s": STUDY_TRIALS / wall_s,
        "trials_per_s_steady": steady,
        "first_trial_done_s": next((x["t"] - t for x in samples if x["done"]), float("nan")),
        "wall_per_trial_x_concurrency_s": per_trial_s,
        "step_loop_s_per_trial": loop_s,
        "fixed_cost_per_trial_s": per_trial_s - loop_s,
        "coordinator_process_cpu_s": coordinator_cpu,
        "tune_run_processes_seen": tune_runs,
        "tune_run_process_cpu_s": tune_cpu,
        # The study's driving CPU: the coordinator (our bookkeeping, the trial events) and the
        # TuneRun processes (Tune's driver loop).
        "coordinator_cpu_per_trial_ms": 1e3 * driving_cpu / STUDY_TRIALS,
        "coordinator_alone_cpu_per_trial_ms": 1e3 * coordinator_cpu / STUDY_TRIALS,
        "coordinator_share_of_fixed_cost": driving_cpu / STUDY_TRIALS / (per_trial_s - loop_s),
        "coordinator_pid_found": any(s["pids"] for s in samples),
        "tune_run_rss_peak_mb": max((x["tune_run_rss_bytes"] for x in samples), default=0) / 2**20,
        # The coordinator's memory (our rows; Tune runs elsewhere) against trials done.
        "coordinator_rss_at_quarter_mb": quarter["rss_bytes"] / 2**20,
        "coordinator_rss_at_end_mb": max((x["rss_bytes"] for x in samples), default=0) / 2**20,
        "coordinator_rss_per_trial_kb": rss_growth_per_trial(samples) / 1024,
        "trials_per_tune_run": STUDY_TRIALS_PER_TUNE_RUN,
        "coordinator_rss_peak_by_tune_run_mb": [round(p / 2**20, 1) for p in rss_peak_by_run(samples)],
    }


def cluster_census(cluster) -> dict:
    """Alive actors by class, placement groups with their bundles, and Ray worker processes by
    title, right now (GCS tables: no dashboard needed)."""
    import ray

    actors = {}
    for a in ray._private.state.actors().values():
        if a.get("State") == "ALIVE":
            name = a.get("ActorClassName", "?")
            actors[name] = actors.get(name, 0) + 1
    pgs = [
        len(p["bundles"]) for p in ray.util.placement_group_table().values() if p.get("state") == "CREATED"
    ]
    processes = {}
    for c in process_tree(raylet_pids(cluster.list_all_nodes())).values():
        title = c.split()[0] if c.startswith("ray::") else "other"
        processes[title] = processes.get(title, 0) + 1
    return {"actors": actors, "placement_group_bundles": pgs, "processes": processes}


def busiest(samples: list[dict]) -> dict:
    return max(samples, key=lambda s: sum(s["actors"].values()) + sum(s["processes"].values()), default={})


def measure_multihost(tmp: str) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from service.orchestration import launch
    from service.planning.trial import TrialPlan

    study = study_spec(
        f"{tmp}/data",
        f"{tmp}/multihost",
        "bench-multihost",
        1,
        MH_STEPS,
        scaling={"num_hosts": MH_HOSTS, "workers_per_host": 1},
    )
    plan = TrialPlan(study, "r-0000", "r", {"learning_rate": 0.05, "momentum": 0.9, "width": 4}, MH_STEPS)
    # As tests/cluster/test_multihost_cluster.py: a head without CPUs (the driver and Ray Train's
    # controller need none) and one 1-CPU node per host.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        for _ in range(MH_HOSTS):
            cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, log_to_driver=False)
        sampler = Sampler(lambda: cluster_census(cluster), 1.0)
        t = time.perf_counter()
        launch.run_single(plan)
        wall_s = time.perf_counter() - t
        census = busiest(sampler.stop())
    finally:
        ray.shutdown()
        cluster.shutdown()
    with open(plan.metrics_uri) as f:
        rows = [json.loads(line) for line in f]
    steps = [0] + [r["step"] for r in rows]
    n = [b - a for a, b in zip(steps[:-1], steps[1:], strict=True)]
    step_s = sum(k / r["steps_per_s"] for k, r in zip(n, rows, strict=True)) / MH_STEPS
    reduce_s = sum(r["multihost/reduce_s"] for r in rows) / MH_STEPS
    bn_sync_s = sum(r["multihost/bn_sync_s"] for r in rows) / MH_STEPS
    return {
        "hosts": MH_HOSTS,
        "workers_per_host": 1,
        "steps": MH_STEPS,
        "eval_every_steps": MH_EVERY,
        "trial_wall_s": wall_s,
        "step_s": step_s,
        "reduce_s_per_step": reduce_s,
        "bn_sync_s_per_step": bn_sync_s,
        "reduce_s_per_eval": reduce_s * MH_EVERY,
        "bn_sync_s_per_eval": bn_sync_s * MH_EVERY,
        "guarantees_share_of_step": (reduce_s + bn_sync_s) / (step_s + reduce_s + bn_sync_s),
        "rank0_gate_s_per_call": rank0_gate_s(),
        "census_while_running": census,
    }


def rank0_gate_s() -> float:
    """What `Rank0.run` adds to a call on a rank that skips it (the gate alone)."""
    from service.distributed.rank0 import Rank0
    from service.distributed.topology import Topology

    gate = Rank0(Topology(world_rank=1, world_size=MH_HOSTS))
    number = 100_000
    return min(timeit.repeat(lambda: gate.run(print), number=number, repeat=3)) / number


def run() -> dict:
    from bench import two_host_round
    from service.data.builtin import write_digits

    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory(prefix="playbook-bench-cluster-") as tmp:
        write_digits(f"{tmp}/data")
        study = measure_study(tmp)
        multihost = measure_multihost(tmp)
    # No goal in issue 11 for these: the figure's value is the fixed cost per trial, its goal
    # the informational "< inf" (it always passes; the numbers are in raw).
    return {
        "cluster": figure("cluster", study["fixed_cost_per_trial_s"], study=study, multihost=multihost),
        # issue 39: a round of two-host trials on a simulated 8-node cluster (TWO_HOST_TRIALS).
        **two_host_round.run(),
    }


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
