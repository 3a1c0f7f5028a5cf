"""Planning a `kind: repeat` round (the playbook's "is this change worth adopting"): for each
scientific value, the best finished trial of the source round is rerun `num_trials` times with
other seeds (its own seed + 1, + 2, ...), as long as it ran and with the schedule it ran, so the
round measures how much its result moves with the seed alone (`analysis.seed_noise` compares
the values against that noise). With no scientific hyperparameter, the best trial is repeated."""

from __future__ import annotations

from service.core import ranking
from service.core.errors import StudyStopped
from service.planning import schedules
from service.planning.rounds import own_fixed, row_hparams, trial_config
from service.study.search import Round
from service.study.spec import Study


def best_per_scientific_value(study: Study, rnd: Round, rows: list[dict]) -> list[dict]:
    """The best finished row of each combination of scientific values (`Study.compared_space`),
    best first."""
    names = [k for k, hp in study.compared_space(rnd).items() if hp.role == "scientific"]
    best: dict[tuple, dict] = {}
    for row in ranking.ranked_results(rows, study.training.mode):
        best.setdefault(tuple(row.get(f"hp/{k}") for k in names), row)
    return list(best.values())


def plan_repeat(study: Study, rnd: Round, rows: list[dict]) -> list[dict]:
    """`num_trials` configs per scientific value, indexed value by value."""
    source = study.source_round(rnd)
    bests = best_per_scientific_value(study, rnd, [r for r in rows if r.get("round") == source.name])
    if not bests:
        raise StudyStopped(f"round {rnd.name}: round {source.name} has no finished trial to repeat")
    configs, fixed = [], own_fixed(study, rnd, rows)
    for best in bests:
        hparams = {**row_hparams(best), **fixed}
        recorded = schedules.from_columns(best)
        schedule = schedules.for_trial(
            recorded or study.training.schedule, hparams if recorded is None else fixed
        )
        steps = best.get("max_train_steps") or study.round_steps(source)
        first_seed = (study.training.seed if best.get("seed") is None else best["seed"]) + 1
        for i in range(rnd.num_trials):
            index = len(configs)
            configs.append(
                trial_config(
                    rnd, index, hparams, steps, first_seed + i, schedule, repeat_of=best["trial_name"]
                )
            )
    return configs
