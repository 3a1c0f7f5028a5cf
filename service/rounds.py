"""Planning a round: the Tune config of each of its trials (no Ray here).

quasi_random (round 1, exploration): scrambled Halton points over the search space.
extend (round 2 and later, the playbook's "how long to train"): the best finished trial of the
source round, rerun `num_trials` times with seeds training.seed, +1, ... for `step_multiplier`
times longer, with the learning-rate schedule extended by `schedules.extend`. Each config
records where its schedule came from.
"""

from __future__ import annotations

import dataclasses
import itertools

from service.errors import PlaybookError
from service.schedules import extend
from service.search import quasi_random_configs
from service.spec import Round, Study


def plan_round(study: Study, rnd: Round, rows: list[dict]) -> list[dict]:
    """Trial configs named `<round>-<index>`; `rows` are the study's trial rows so far."""
    steps = study.round_steps(rnd)
    if rnd.kind == "grid":
        return [_config(rnd, i, hp, steps) for i, hp in enumerate(grid_configs(study.search))]
    if rnd.kind == "quasi_random":
        points = quasi_random_configs(study.search, rnd.num_trials, rnd.seed)
        return [_config(rnd, i, hp, steps) for i, hp in enumerate(points)]

    source = study.source_round(rnd)
    best = best_finished(rows, source.name, study.training.mode)
    if best is None:
        raise PlaybookError(f"round {rnd.name}: round {source.name} has no finished trial to extend")
    hparams = {k.removeprefix("hp/"): v for k, v in best.items() if k.startswith("hp/")}
    old_steps = study.round_steps(source)
    schedule = extend(study.training.schedule, old_steps, steps)
    kind, source_trial = study.training.schedule.kind, best["trial_name"]
    origin = {
        "extended_from": source_trial,
        "schedule_origin": f"{kind} schedule of {source_trial} ({old_steps} steps) extended to {steps} steps",
    }
    return [
        _config(
            rnd,
            i,
            hparams,
            steps,
            seed=study.training.seed + i,
            schedule=dataclasses.asdict(schedule),
            **origin,
        )
        for i in range(rnd.num_trials)
    ]


def _config(rnd: Round, index: int, hparams: dict, steps: int, **extra) -> dict:
    return {
        "trial_name": f"{rnd.name}-{index:04d}",
        "round": rnd.name,
        "hparams": hparams,
        "max_train_steps": steps,
        **extra,
    }


def best_finished(rows: list[dict], round_name: str, mode: str) -> dict | None:
    done = [
        r
        for r in rows
        if r.get("round") == round_name and r.get("status") == "FINISHED" and r.get("best_metric") is not None
    ]
    sign = 1 if mode == "min" else -1
    return min(done, key=lambda r: (sign * r["best_metric"], r["trial_name"]), default=None)


def grid_configs(space: dict) -> list[dict]:
    """Every combination of the searched choice dimensions' values (fixed ones added)."""
    searched = [(k, hp.values) for k, hp in space.items() if hp.searched]
    fixed = {k: hp.value for k, hp in space.items() if not hp.searched}
    names = [k for k, _ in searched]
    return [
        {**dict(zip(names, combo, strict=True)), **fixed}
        for combo in itertools.product(*(v for _, v in searched))
    ]
