"""trial_overhead_ratio: the fixed cost of one single-host trial (launch -> first step, last
step -> done) of the service over a plain Ray Tune function trial doing the same work (read
the data, build the model, the same steps, an evaluation and a torch.save at each report).

Each candidate runs as a one-trial Tuner on one local Ray cluster, alternating, after a warm-up;
overhead = Tuner.fit() wall time - the trial's own step-loop time. Also measured: the same
trial through Ray Train (`TorchTrainer.fit`, the path before the fast path and still the one
of multi-worker trials), and what the imports of a fresh worker process cost.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench.common import figure

STEPS, EVERY, BATCH, REPEATS = 100, 50, 64, 3
HPARAMS = {"learning_rate": 0.05, "momentum": 0.9, "width": 16, "weight_decay": 0.0}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def plain_trial(config: dict) -> None:
    """What a user writes by hand as a Tune function trial."""
    import pyarrow.parquet as pq
    import ray.tune
    import torch
    import torch.nn.functional as F

    from service.workloads.digits import SmallConvNet

    torch.set_num_threads(1)

    def load(split):
        t = pq.read_table(f"{config['data']}/{split}")
        x = t.column("pixels").combine_chunks().flatten().to_numpy().reshape(-1, 1, 8, 8)
        return torch.from_numpy(x), torch.from_numpy(t.column("label").to_numpy())

    (x, y), (vx, vy) = load("train"), load("validation")
    torch.manual_seed(0)
    model = SmallConvNet(10, HPARAMS["width"])
    opt = torch.optim.SGD(model.parameters(), lr=HPARAMS["learning_rate"], momentum=HPARAMS["momentum"])
    loop_s, perm, pos = 0.0, torch.randperm(len(y)), 0
    for step in range(1, STEPS + 1):
        t = time.perf_counter()
        if pos + BATCH > len(y):
            perm, pos = torch.randperm(len(y)), 0
        i = perm[pos : pos + BATCH]
        pos += BATCH
        loss = F.cross_entropy(model(x[i]), y[i])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loop_s += time.perf_counter() - t
        if step % EVERY == 0:
            model.eval()
            with torch.no_grad():
                val = float(F.cross_entropy(model(vx), vy))
            model.train()
            os.makedirs(f"{config['out']}/ckpt-{step}", exist_ok=True)
            torch.save(
                {"model": model.state_dict(), "opt": opt.state_dict()}, f"{config['out']}/ckpt-{step}/s.pt"
            )
            ray.tune.report({"step": step, "validation/loss": val, "loop_s": loop_s})


def ray_train_trial(config: dict, study) -> None:
    """The service's trial as it ran before the fast path: one TorchTrainer.fit per trial."""
    import ray.tune

    from service.orchestration import launch

    plan = launch.TrialPlan(study, config["trial_name"], "r", dict(HPARAMS), STEPS)
    ray.tune.report({**launch.summarize(plan, launch.trainer_for(plan, in_tune=True).fit()), "summary": True})


def service_study(data_dir: str, storage: str):
    from service.study import spec

    return spec.load_dict(
        {
            "name": "bench-trial",
            "workload": "digits",
            "data": {s: f"{data_dir}/{s}" for s in ("train", "validation")},
            "storage": storage,
            "training": {
                "max_train_steps": STEPS,
                "batch_size": BATCH,
                "eval_batch_size": 256,
                "eval_every_steps": EVERY,
                "optimizer": "sgd_momentum",
                "schedule": {"kind": "constant"},
            },
            "search": {k: {"role": "fixed", "value": v} for k, v in HPARAMS.items()},
            "rounds": [{"name": "r", "num_trials": 1}],
        }
    )


def loop_seconds(study, trial_name: str) -> float:
    """The service trial's step-loop time, from its metrics log (steps / steps_per_s per row)."""
    with open(os.path.join(study.study_uri, "trials", trial_name, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    steps = [0] + [r["step"] for r in rows]
    return sum((b - a) / r["steps_per_s"] for a, b, r in zip(steps[:-1], steps[1:], rows, strict=True))


def run_tuner(trainable, config: dict, storage: str, name: str):
    from ray import tune

    tuner = tune.Tuner(
        trainable,
        param_space=config,
        run_config=tune.RunConfig(name=name, storage_path=storage, verbose=0),
    )
    t = time.perf_counter()
    grid = tuner.fit()
    wall = time.perf_counter() - t
    result = grid[0]
    if result.error:
        raise RuntimeError(f"{name}: {result.error}")
    return wall, result


def import_seconds(module: str) -> float:
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def run() -> dict:
    import ray
    from ray import tune

    from service.data.builtin import write_digits
    from service.orchestration.tune_run import study_trainable

    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    walls = {"plain": [], "service": [], "ray_train": []}
    loops = {"plain": [], "service": [], "ray_train": []}
    try:
        with tempfile.TemporaryDirectory(prefix="playbook-bench-trial-") as tmp:
            data = f"{tmp}/data"
            write_digits(data)
            tune_dir = f"{tmp}/tune"
            study = service_study(data, f"{tmp}/studies")
            service_fn = study_trainable(study)
            train_fn = tune.with_resources(tune.with_parameters(ray_train_trial, study=study), {"cpu": 0.01})
            plain_fn = tune.with_resources(plain_trial, {"cpu": 1})

            def trial_config(name: str) -> dict:
                return {
                    "trial": {
                        "trial_name": name,
                        "round": "r",
                        "hparams": dict(HPARAMS),
                        "max_train_steps": STEPS,
                    }
                }

            for i in range(REPEATS + 1):  # run 0 warms the cluster up and is not counted
                name = f"r-{i:04d}"
                w, r = run_tuner(plain_fn, {"data": data, "out": f"{tmp}/plain-{i}"}, tune_dir, f"plain-{i}")
                if i:
                    walls["plain"].append(w)
                    loops["plain"].append(r.metrics["loop_s"])
                w, _ = run_tuner(service_fn, trial_config(name), tune_dir, f"service-{i}")
                if i:
                    walls["service"].append(w)
                    loops["service"].append(loop_seconds(study, name))
                if i == REPEATS:  # Ray Train (~15-40 s a trial here): once, for context
                    name = f"t-{i:04d}"
                    w, _ = run_tuner(train_fn, {"trial_name": name}, tune_dir, f"train-{i}")
                    walls["ray_train"].append(w)
                    loops["ray_train"].append(loop_seconds(study, name))
    finally:
        ray.shutdown()
    med = statistics.median
    overhead = {k: med([w - s for w, s in zip(walls[k], loops[k], strict=True)]) for k in walls}
    imports = {
        m: import_seconds(m) for m in ("torch", "ray.tune", "ray.train.torch", "service.orchestration.launch")
    }
    raw = {
        "plain_overhead_s": overhead["plain"],
        "service_overhead_s": overhead["service"],
        "plain_wall_s": walls["plain"],
        "service_wall_s": walls["service"],
        "plain_loop_s": loops["plain"],
        "service_loop_s": loops["service"],
        "ray_train_overhead_s": overhead["ray_train"],
        "ray_train_wall_s": walls["ray_train"],
        "ray_train_overhead_ratio": overhead["ray_train"] / overhead["plain"],
        "import_s_fresh_process": imports,
        "steps": STEPS,
        "repeats": REPEATS,
    }
    return {
        "trial_overhead_ratio": figure("trial_overhead_ratio", overhead["service"] / overhead["plain"], **raw)
    }


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
