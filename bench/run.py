"""`make bench`: the benchmarks in turn, results to bench/results.json, then the tables.

python -m bench.run [--only NAME ...]   (names: step lm loaders checkpoints trial demo scale tune_memory
                                          cluster coordinator_memory ddp_buckets fsdp)
Without --only every suite runs except the long scale runs in LONG (`make bench-scale`
runs the coordinator-memory study, `make bench-cluster` is `--only cluster`). Figures not
measured in a run are kept from the existing results.json; each figure records when it was
measured, and the tables show that date, so a long run's last stored figure is read with its
date.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import time

from bench import table

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results.json")
SUITES = {
    "step": "bench.step",
    "cnn": "bench.cnn",
    "lm": "bench.lm",
    "loaders": "bench.loaders",
    "checkpoints": "bench.checkpoints",
    "trial": "bench.trial_overhead",
    "demo": "bench.demo",
    "scale": "bench.scale",
    "tune_memory": "bench.tune_memory",
    "cluster": "bench.cluster",
    "coordinator_memory": "bench.coordinator_memory",
    "ddp_buckets": "bench.ddp_buckets",
    "fsdp": "bench.fsdp",
}
LONG = ("coordinator_memory", "cluster")
"""Suites that run for longer than `make bench` should take (see docs/scale.md): only by name."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--only", nargs="+", choices=sorted(SUITES))
    args = p.parse_args(argv)
    for name in args.only or [s for s in SUITES if s not in LONG]:
        t = time.perf_counter()
        figures = importlib.import_module(SUITES[name]).run()
        when = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        elapsed = time.perf_counter() - t
        for fig in figures.values():
            fig["raw"]["measured_at"] = when
            fig["raw"]["suite_s"] = round(elapsed)  # how long its suite ran (make bench's length)
        for key, fig in figures.items():
            verdict = "info" if fig["goal"] == "informational" else "ok  " if fig["pass"] else "MISS"
            print(f"{verdict} {key} = {fig['value']:g} (goal {fig['goal']})", flush=True)
        print(f"     [{name}: {elapsed:.0f} s]", flush=True)
        save(figures)  # after each suite: a later failure keeps what was measured
    table.main()
    return 0


def save(figures: dict) -> None:
    """Merge `figures` into results.json as it is on disk now (another run may have saved
    its figures since this one started), keeping every other figure."""
    results = {"figures": {}}
    if os.path.exists(RESULTS):
        with open(RESULTS) as f:
            results = json.load(f)
    results["figures"].update(figures)
    results["machine"] = {
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_avg_1m": os.getloadavg()[0],
    }
    with open(RESULTS, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    raise SystemExit(main())
