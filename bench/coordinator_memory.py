"""coordinator_memory: the coordinator actor's resident memory against trials done, in a real
study long enough to see where it levels off (issue 11: "memory of the coordinator actor
against the number of trials; goal: flat per trial beyond the rows themselves").

A quasi-random round of `TRIALS` tiny one-worker digits trials (the cluster bench's study,
Tune runs of the default size) on a local 2-CPU cluster. Every `SAMPLE_S` the coordinator's
resident anonymous memory (RssAnon, /proc) and the trials done (from the actor). A sample
taken during a rewrite of the trial table includes its transient buffers (up to ~15 MB at
thousands of rows), so each bin of `BIN` trials is summed up by its lowest sample, the floor:
what the process holds between rewrites. The value is the least-squares growth per trial of
the floors over the second half of the study minus what its trial rows grew by per trial there
(their deep size, read from the actor at the half and at the end): ~0 when the coordinator holds
nothing per trial beyond its rows. The first half shows the allocators' warm-up (their
high-water marks rise with the first couple of thousand trials).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import tempfile
import time

from bench.cluster import STUDY_STEPS, study_spec
from bench.common import figure

TRIALS = 15000  # ~27 minutes here; the growth levels off after the first couple of thousand
SAMPLE_S = 2.0
BIN = 250


def rss_anon_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# Run inside the coordinator actor (`__ray_call__`): the first argument is the actor.
def actor_state(coordinator) -> dict:
    rows = coordinator.table.rows
    return {
        "pid": os.getpid(),
        "done": sum(1 for r in list(rows.values()) if r.get("status") == "FINISHED"),
    }


def rows_bytes(coordinator) -> int:
    """Deep size of the trial table's rows (each object once: shared keys and values count once)."""
    seen: set[int] = set()

    def size(o) -> int:
        if id(o) in seen:
            return 0
        seen.add(id(o))
        n = sys.getsizeof(o)
        if isinstance(o, dict):
            n += sum(size(k) + size(v) for k, v in o.items())
        return n

    return size(coordinator.table.rows)


def slope(points: list[tuple[float, float]]) -> float:
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    var = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / var if var else float("nan")


def measure(tmp: str) -> dict:
    import ray

    from service.data.builtin import write_digits
    from service.orchestration import coordinator as coord

    write_digits(f"{tmp}/data")
    study = study_spec(f"{tmp}/data", f"{tmp}/studies", "bench-memory", TRIALS, STUDY_STEPS)
    study = dataclasses.replace(study, rounds=[dataclasses.replace(study.rounds[0], trials_per_tune_run=0)])
    ray.init(
        address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, namespace=coord.NAMESPACE
    )
    try:
        actor = coord.Coordinator.options(name=coord.actor_name(study.name)).remote(study)
        run = actor.run.remote()
        samples, rows_at, t0 = [], {}, time.perf_counter()
        while not ray.wait([run], timeout=SAMPLE_S)[0]:
            state = ray.get(actor.__ray_call__.remote(actor_state))
            samples.append(
                {"done": state["done"], "rss": rss_anon_bytes(state["pid"]), "t": time.perf_counter() - t0}
            )
            if "half" not in rows_at and state["done"] >= TRIALS // 2:
                rows_at["half"] = (state["done"], ray.get(actor.__ray_call__.remote(rows_bytes)))
        rows = ray.get(run)
        rows_at["end"] = (TRIALS, ray.get(actor.__ray_call__.remote(rows_bytes)))
        ray.kill(actor)
    finally:
        ray.shutdown()
    samples = [s for s in samples if s["rss"]]
    floors = floor_by_bin(samples)
    second = [(d, r) for d, r in floors if d >= TRIALS // 2]
    first = [(d, r) for d, r in floors if TRIALS // 10 <= d < TRIALS // 2]
    (d0, r0), (d1, r1) = rows_at["half"], rows_at["end"]
    return {
        "trials": TRIALS,
        "trials_finished": sum(1 for r in rows if r.get("status") == "FINISHED"),
        "wall_s": round(samples[-1]["t"], 1) if samples else None,
        "samples": len(samples),
        "floor_rss_anon_mb_by_trials_done": [[d, round(r / 2**20, 1)] for d, r in floors],
        "peak_rss_anon_mb": round(max(s["rss"] for s in samples) / 2**20, 1),
        "growth_per_trial_first_half_kb": round(slope(first) / 1024, 2),
        "growth_per_trial_second_half_kb": round(slope(second) / 1024, 2),
        "rows_growth_per_trial_kb": round((r1 - r0) / max(d1 - d0, 1) / 1024, 2),
        "rows_mb_at_end": round(r1 / 2**20, 2),
    }


def floor_by_bin(samples: list[dict]) -> list[tuple[int, int]]:
    """(bin's middle in trials done, its lowest resident sample) for each bin of BIN trials."""
    bins: dict[int, int] = {}
    for s in samples:
        if s["done"] >= TRIALS:  # the round's end: its verdicts and last writes, not a trial's
            continue
        k = s["done"] // BIN
        bins[k] = min(bins.get(k, s["rss"]), s["rss"])
    return [(k * BIN + BIN // 2, r) for k, r in sorted(bins.items())]


def run() -> dict:
    with tempfile.TemporaryDirectory(prefix="playbook-bench-memory-") as tmp:
        m = measure(tmp)
    beyond = m["growth_per_trial_second_half_kb"] - m["rows_growth_per_trial_kb"]
    return {"coordinator_memory": figure("coordinator_memory", beyond, **m)}
