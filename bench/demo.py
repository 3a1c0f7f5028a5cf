"""demo_wall_s: `playbook demo` (what `make demo` runs after setup) end to end: the digits data
written, both rounds of studies/digits-demo.yaml on an embedded local Ray. The study is copied
with its data and storage pointed at a fresh temporary folder, so a previous demo's results
(which a rerun would resume) never shorten it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import yaml

from bench.common import ROOT, figure


def run() -> dict:
    with open(os.path.join(ROOT, "studies", "digits-demo.yaml")) as f:
        study = yaml.safe_load(f)
    with tempfile.TemporaryDirectory(prefix="playbook-bench-demo-") as tmp:
        study["data"] = {s: f"{tmp}/data/{s}" for s in ("train", "validation", "test")}
        study["storage"] = f"{tmp}/studies"
        path = os.path.join(tmp, "digits-demo.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(study, f)
        env = {**os.environ, "RAY_ADDRESS": "local"}  # a fresh embedded Ray, not one found on this machine
        t = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-m", "service", "demo", "--study-file", path],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - t
        if out.returncode != 0:
            raise RuntimeError(f"playbook demo failed ({out.returncode}):\n{out.stderr[-3000:]}")
    trials = sum(r.get("num_trials", 0) for r in study["rounds"])
    return {"demo_wall_s": figure("demo_wall_s", wall, trials=trials, command="playbook demo")}


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
