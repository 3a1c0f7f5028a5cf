"""Planning a round: the Tune config of each of its trials (no Ray here).

quasi_random (round 1, exploration): scrambled Halton points over the search space.
extend (round 2 and later, the playbook's "how long to train"): the best finished trial of the
source round, rerun `num_trials` times with seeds training.seed, +1, ... for `step_multiplier`
times longer, with the learning-rate schedule that trial ran (its row's `schedule/*` columns,
for its own max_train_steps) extended by `schedules.extend`, so a third round keeps round 1's
linear decay length and cosine base LR. Every config names its trial's schedule and seed, and
an extended one records where its schedule came from; `row_fields` is what the trial row
records of it.

Each round plans in its own space (`Study.round_space`: the study's `search:` with the round's
entries over it), a `best_of` entry fixed to the value of the best finished trial of the round
it names (`resolved_space`); an extend or repeat round's own entries fix values on top of the
configuration it reruns. A source round of another study (`from_round: other/round`) is found
in `rows` under that name: the coordinator adds that study's rows, renamed (`as_source_rows`).
"""

from __future__ import annotations

import itertools

from service.core import ranking
from service.core.errors import PlaybookError, StudyStopped
from service.planning import schedules
from service.planning.search import quasi_random_configs
from service.study.search import HParam, Round
from service.study.spec import Study, schedule_from_dict
from service.study.training import Schedule


def plan_round(study: Study, rnd: Round, rows: list[dict]) -> list[dict]:
    """Trial configs named `<round>-<index>`; `rows` are the study's trial rows so far."""
    if rnd.kind == "extend":
        return _extend(study, rnd, rows)
    if rnd.kind == "bayesian":
        raise PlaybookError(f"round {rnd.name}: a bayesian round's trials are planned by its searcher")
    if rnd.kind == "repeat":
        from service.planning.repeat import plan_repeat  # repeat.py builds on trial_config here

        return plan_repeat(study, rnd, rows)
    space = resolved_space(study, rnd, rows)
    if rnd.kind == "grid":
        points = grid_configs(space)
    else:
        points = quasi_random_configs(space, rnd.num_trials, rnd.seed)
    base = study.training.schedule
    return [
        trial_config(rnd, i, hp, study.round_steps(rnd), study.training.seed, schedules.for_trial(base, hp))
        for i, hp in enumerate(points)
    ]


def _extend(study: Study, rnd: Round, rows: list[dict]) -> list[dict]:
    source = study.source_round(rnd)
    best = ranking.best_result([r for r in rows if r.get("round") == source.name], study.training.mode)
    if best is None:
        raise StudyStopped(f"round {rnd.name}: round {source.name} has no finished trial to extend")
    fixed = own_fixed(study, rnd, rows)
    hparams = {**row_hparams(best), **fixed}
    # The schedule the trial ran, for as long as it ran (a row from before rows recorded a
    # schedule: the study's with the row's hyperparameters, and the origin says so).
    recorded = schedules.from_columns(best)
    old = schedules.for_trial(recorded or study.training.schedule, hparams if recorded is None else fixed)
    old_steps = best.get("max_train_steps") or study.round_steps(source)
    steps, name = study.round_steps(rnd), best["trial_name"]
    origin = schedules.describe_extension(name, old, old_steps, steps)
    if recorded is None:
        origin += " (its row records no schedule: taken as the study's with its hyperparameters)"
    new = schedules.extend(old, old_steps, steps)
    return [
        trial_config(
            rnd, i, hparams, steps, study.training.seed + i, new, extended_from=name, schedule_origin=origin
        )
        for i in range(rnd.num_trials)
    ]


def resolved_space(study: Study, rnd: Round, rows: list[dict]) -> dict[str, HParam]:
    """`Study.round_space`, each `best_of` entry fixed to the value its round's best finished
    trial took."""
    space = study.round_space(rnd)
    for name, hp in space.items():
        if hp.best_of is not None:
            best = ranking.best_result([r for r in rows if r.get("round") == hp.best_of], study.training.mode)
            if best is None:
                raise StudyStopped(
                    f"round {rnd.name}: round {hp.best_of} has no finished trial to take {name}'s value from"
                )
            space[name] = HParam(role="fixed", value=best[f"hp/{name}"])
    return space


def own_fixed(study: Study, rnd: Round, rows: list[dict]) -> dict:
    """The values the round's own `search:` entries fix (resolved)."""
    space = resolved_space(study, rnd, rows)
    return {name: space[name].value for name in rnd.search}


def row_hparams(row: dict) -> dict:
    """A trial row's hyperparameters (its `hp/<name>` columns)."""
    return {k.removeprefix("hp/"): v for k, v in row.items() if k.startswith("hp/")}


def as_source_rows(study_name: str, rows: list[dict]) -> list[dict]:
    """Another study's trial rows as a round of this study sees them when it builds on one of
    that study's rounds: round and trial names prefixed `<study>/` (so `extended_from` and
    `repeat_of` record where a configuration came from)."""
    return [
        {**r, "round": f"{study_name}/{r.get('round')}", "trial_name": f"{study_name}/{r['trial_name']}"}
        for r in rows
    ]


def row_fields(config: dict) -> dict:
    """What a trial's row records of its config: hyperparameters as `hp/<name>`, the schedule
    as `schedule/<field>`, its seed and (extended) where it came from."""
    return {
        **{f"hp/{k}": v for k, v in config["hparams"].items()},
        **schedules.to_columns(schedule_from_dict(config["schedule"])),
        **{k: config[k] for k in ("seed", "extended_from", "schedule_origin", "repeat_of") if k in config},
    }


def trial_config(
    rnd: Round, index: int, hparams: dict, steps: int, seed: int, schedule: Schedule, **extra
) -> dict:
    return {
        "trial_name": f"{rnd.name}-{index:04d}",
        "round": rnd.name,
        "hparams": hparams,
        "max_train_steps": steps,
        "seed": seed,
        "schedule": schedules.as_dict(schedule),
        **extra,
    }


def grid_configs(space: dict) -> list[dict]:
    """Every combination of the searched choice dimensions' values (fixed ones added)."""
    searched = [(k, hp.values) for k, hp in space.items() if hp.searched]
    fixed = {k: hp.value for k, hp in space.items() if not hp.searched}
    names = [k for k, _ in searched]
    return [
        {**dict(zip(names, combo, strict=True)), **fixed}
        for combo in itertools.product(*(v for _, v in searched))
    ]
