"""trial_overhead_ratio: the fixed cost of one single-host trial (launch -> first step, last
step -> done) of the service over a plain Ray Tune function trial doing the same work (read
the data, build the model, the same steps, an evaluation and a torch.save at each report).

Each candidate runs as a one-trial Tuner on one local Ray cluster, alternating, after a warm-up;
overhead = Tuner.fit() wall time - the trial's own step-loop time. Also measured: the same
trial through Ray Train (`TorchTrainer.fit`, the path before the fast path and still the one
of multi-worker trials without `scaling.reuse_workers`), and what the imports of a fresh worker
process cost.

multiworker_trial_overhead_ratio: the fixed cost per trial of a round of ROUND_TRIALS two-worker
trials with nothing set in the study but the layout (reused workers, the default: the round's
Tuner.fit() wall time - its trials' step-loop time, over the trials) / the plain Tune function
trial's overhead above.

eval_interval_wait_s: per evaluation of those two-worker trials (after a trial's first), the
seconds between two of its reports to Tune spent neither in the interval's steps nor in its
metric all-reduce, BN sync, evaluation or checkpoint: what a report waits to go through (on a
Ray Train run, its controller's poll) and the metrics log's write. Beside it, the same of a
round of Ray Train runs (`reuse_workers: false`), at the poll interval `playbook run` sets.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench.common import ROOT, figure

STEPS, EVERY, BATCH, REPEATS = 100, 50, 64, 3
ROUND_TRIALS = 20
RAY_TRAIN_TRIALS = 3
HPARAMS = {"learning_rate": 0.05, "momentum": 0.9, "width": 16, "weight_decay": 0.0}


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

    from service.orchestration import launch, trial_summary

    plan = launch.TrialPlan(study, config["trial_name"], "r", dict(HPARAMS), STEPS)
    ray.tune.report(
        {**trial_summary.summarize(plan, launch.trainer_for(plan, in_tune=True).fit()), "summary": True}
    )


def service_study(data_dir: str, storage: str, name: str = "bench-trial", scaling: dict | None = None):
    from service.study import spec

    return spec.load_dict(
        {
            "name": name,
            "workload": "digits",
            "scaling": scaling or {},
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


def trial_config(name: str) -> dict:
    """A Tune trial's config for the service's trainable: the trial of `HPARAMS`, named `name`."""
    return {"trial_name": name, "round": "r", "hparams": dict(HPARAMS), "max_train_steps": STEPS}


def run_round(trainable, param_space: dict, tune_dir: str, name: str) -> tuple[float, list]:
    """One Tuner's trials, one at a time, each trial's process serving the next
    (`reuse_actors`, as a TuneRun runs a round): (wall time, the trials' results)."""
    from ray import tune

    tuner = tune.Tuner(
        trainable,
        param_space=param_space,
        tune_config=tune.TuneConfig(max_concurrent_trials=1, reuse_actors=True),
        run_config=tune.RunConfig(name=name, storage_path=tune_dir, verbose=0),
    )
    t = time.perf_counter()
    grid = tuner.fit()
    wall = time.perf_counter() - t
    results = list(grid)
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"{name}: {errors[0]}")
    return wall, results


def service_round(data: str, storage: str, tune_dir: str, name: str, scaling: dict, trials: int):
    """A round of `trials` of the service's trials with `scaling`, run as `run_round` runs one:
    (study, trial names, wall time, the trials' results)."""
    from ray import tune

    from service.orchestration.tune_fit import study_trainable

    study = service_study(data, storage, f"bench-{name}", scaling)
    names = [f"{name}-{i:04d}" for i in range(trials)]
    space = {"trial": tune.grid_search([trial_config(n) for n in names])}
    wall, results = run_round(study_trainable(study), space, tune_dir, name)
    return study, names, wall, results


def pooled_round(data: str, storage: str, tune_dir: str) -> dict:
    """A round of ROUND_TRIALS two-worker trials, nothing set but the layout (a reused pool), on
    this 2-CPU cluster: its wall time, the trials' step-loop time, and the fixed cost per trial
    (the rest, over the trials)."""
    layout = {"num_hosts": 1, "workers_per_host": 2}
    study, names, wall, results = service_round(data, storage, tune_dir, "multiworker", layout, ROUND_TRIALS)
    loop = sum(loop_seconds(study, n) for n in names)
    return {
        "multiworker_overhead_s": (wall - loop) / ROUND_TRIALS,
        "multiworker_round_wall_s": wall,
        "multiworker_round_loop_s": loop,
        "multiworker_trials": ROUND_TRIALS,
        "eval_waits_s": eval_waits(results),
    }


def ray_train_round_waits(data: str, storage: str, tune_dir: str) -> list[float]:
    """`eval_waits` of a round of RAY_TRAIN_TRIALS two-worker Ray Train runs, for context."""
    layout = {"num_hosts": 1, "workers_per_host": 2, "reuse_workers": False}
    _, _, _, results = service_round(data, storage, tune_dir, "multiworker-train", layout, RAY_TRAIN_TRIALS)
    return eval_waits(results)


BUSY = ("multihost/reduce_s", "multihost/bn_sync_s", "eval_s", "checkpoint_s")
"""An evaluation's timed work besides its interval's steps (`trainer.loop`)."""


def eval_waits(results) -> list[float]:
    """Per evaluation after each trial's first (whose interval also holds the trial's start):
    Tune's time since the trial's previous report less the interval's steps and BUSY."""
    waits = []
    for result in results:
        rows = [r for r in result.metrics_dataframe.to_dict("records") if r.get("steps_per_s", 0) > 0]
        for prev, row in zip(rows, rows[1:], strict=False):
            steps_s = (row["step"] - prev["step"]) / row["steps_per_s"]
            waits.append(row["time_this_iter_s"] - steps_s - sum(row[k] for k in BUSY))
    return waits


def plain_round_overhead(plain_fn, data: str, out: str, tune_dir: str) -> float:
    """For context: the fixed cost per trial of a round of ROUND_TRIALS plain function trials
    run the same way (the Tuner's own start-up spread over the round, as in `pooled_round`)."""
    from ray import tune

    space = {"data": data, "out": tune.grid_search([f"{out}/{i}" for i in range(ROUND_TRIALS)])}
    wall, results = run_round(plain_fn, space, tune_dir, "plain-round")
    return (wall - sum(r.metrics["loop_s"] for r in results)) / ROUND_TRIALS


def round_figures(plain_fn, data: str, tmp: str, tune_dir: str) -> dict:
    """The multi-worker round's figures, and the plain round's fixed cost per trial beside them."""
    pooled = pooled_round(data, f"{tmp}/studies", tune_dir)
    plain = plain_round_overhead(plain_fn, data, f"{tmp}/plain-round", tune_dir)
    train_waits = ray_train_round_waits(data, f"{tmp}/studies", tune_dir)
    return {**pooled, "plain_round_overhead_s": plain, "ray_train_eval_waits_s": train_waits}


def import_seconds(module: str) -> float:
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def run() -> dict:
    import ray
    from ray import tune

    from service.cli.prepare import train_poll_env
    from service.data.builtin import write_digits
    from service.orchestration.tune_fit import study_trainable

    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    os.environ.update(train_poll_env())  # Ray Train's poll interval as `playbook run` sets it
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

            for i in range(REPEATS + 1):  # run 0 warms the cluster up and is not counted
                name = f"r-{i:04d}"
                w, r = run_tuner(plain_fn, {"data": data, "out": f"{tmp}/plain-{i}"}, tune_dir, f"plain-{i}")
                if i:
                    walls["plain"].append(w)
                    loops["plain"].append(r.metrics["loop_s"])
                w, _ = run_tuner(service_fn, {"trial": trial_config(name)}, tune_dir, f"service-{i}")
                if i:
                    walls["service"].append(w)
                    loops["service"].append(loop_seconds(study, name))
                if i == REPEATS:  # Ray Train (~15-40 s a trial here): once, for context
                    name = f"t-{i:04d}"
                    w, _ = run_tuner(train_fn, {"trial_name": name}, tune_dir, f"train-{i}")
                    walls["ray_train"].append(w)
                    loops["ray_train"].append(loop_seconds(study, name))
            pooled = round_figures(plain_fn, data, tmp, tune_dir)
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
    single = overhead["service"] / overhead["plain"]
    multiworker = pooled["multiworker_overhead_s"] / overhead["plain"]
    waits = {k: pooled.pop(k) for k in ("eval_waits_s", "ray_train_eval_waits_s")}
    return {
        "eval_interval_wait_s": figure(
            "eval_interval_wait_s",
            med(waits["eval_waits_s"]),
            median_s=med(waits["eval_waits_s"]),
            evaluations=len(waits["eval_waits_s"]),
            max_s=max(waits["eval_waits_s"]),
            ray_train_median_s=med(waits["ray_train_eval_waits_s"]),
            ray_train_evaluations=len(waits["ray_train_eval_waits_s"]),
        ),
        "trial_overhead_ratio": figure("trial_overhead_ratio", single, **raw),
        "multiworker_trial_overhead_ratio": figure(
            "multiworker_trial_overhead_ratio", multiworker, plain_overhead_s=overhead["plain"], **pooled
        ),
    }


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
