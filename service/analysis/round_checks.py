"""The playbook checks that need the study as well as its trial rows: the verdicts of one round
(with the study's eval interval, eval sample and budget) and the warnings `playbook validate`
prints before anything runs.

* the best-step rule across a round's trials (`verdicts.best_step_distribution`) and whether
  the first evaluation comes early enough to see a best step in the first 10% of training;
* the eval sample's noise against the gaps the round ranks its trials by
  (`eval_noise.eval_noise`), with the standard error measured on the saved predictions;
* compute-bound or not (`budget:`): the steps spent against the budget, and whether round 1
  spent more than its share (`budget.first_round_share` of `budget.max_total_steps`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from service.analysis.eval_noise import RATE_METRICS, eval_noise, rate_standard_error, standard_error
from service.analysis.verdicts import (
    EARLY_FRACTION,
    OK,
    WARNING,
    Verdict,
    early_is_visible,
    make_verdict,
    percent,
    reached_best_step,
    study_verdicts,
)
from service.core.ranking import ranked_results
from service.core.trial_status import TrialStatus
from service.planning.plan_size import round_trials
from service.study.spec import Study

BEST_STEP_KINDS = ("best_step_position", "best_step_distribution")


def verdicts_for_round(
    study: Study,
    round_name: str,
    rows: list[dict],
    histories: Mapping[str, list[dict]] | None = None,
) -> list[Verdict]:
    """A round's verdicts. An exploration round gets every check; an extend round reruns one
    configuration (a repeat round one per scientific value), so only where its best
    checkpoints sit is meaningful (search-space, trial-count and eval-noise checks would judge
    a single point). Compute-bound studies also get the budget verdict.

    The best-step checks judge each finished trial at the step where it first reached its best
    value (`reached_best_steps`), from its metrics log: `histories` by trial name, or
    (None) read from storage (`metrics_logs`)."""
    mine = [r for r in rows if r.get("round") == round_name]
    rnd = next(r for r in study.rounds if r.name == round_name)
    kind = rnd.kind
    compute_bound = bool(study.budget and study.budget.compute_bound)
    tr = study.training
    space = study.compared_space(rnd)  # the round's own search space
    finished = [r for r in mine if r.get("status") == TrialStatus.FINISHED]
    logs = metrics_logs(study, finished) if histories is None else histories
    reached = reached_best_steps(finished, logs, tr.metric, tr.mode)
    verdicts = study_verdicts(mine, space, tr.mode, tr.eval_every_steps, compute_bound, reached)
    if kind in ("extend", "repeat"):
        verdicts = [v for v in verdicts if v.kind in BEST_STEP_KINDS]
    elif tr.validation_sample_size is not None:
        noise = sample_noise(study, mine)
        verdicts += [noise] if noise else []
    if compute_bound:
        verdicts.append(budget_spent(study, round_name, rows))
    return verdicts


def reached_best_steps(
    rows: Iterable[Mapping[str, Any]],
    histories: Mapping[str, Iterable[Mapping[str, Any]]],
    metric: str,
    mode: str,
) -> dict[str, int]:
    """`reached_best_step` of each row that has a metrics log in `histories`, by trial name."""
    out = {}
    for r in rows:
        name = str(r.get("trial_name"))
        if histories.get(name):
            step = reached_best_step(r, histories[name], metric, mode)
            if step is not None:
                out[name] = step
    return out


def metrics_logs(study: Study, rows: list[dict]) -> dict[str, list[dict]]:
    """The metrics logs (`<trial>/metrics.jsonl`) of these trial rows, by trial name."""
    from service.trainer import metrics_log

    return {r["trial_name"]: metrics_log.read(study.layout.trial(r["trial_name"]).metrics_log) for r in rows}


# ----------------------------------------------------------------------------- eval noise


def sample_noise(study: Study, rows: list[dict]) -> Verdict | None:
    """`eval_noise` for a round: the standard error measured on the best trial's saved
    predictions at its best step (of the sample; of the full validation set when the sample
    was not used, a `validation_sample_size` at least the set's size), else (none saved) the
    binomial one of a rate metric at the best result; neither: None."""
    tr = study.training
    ranked = ranked_results(rows, tr.mode)
    if len(ranked) < 2:
        return None
    best = ranked[0]
    saved = _saved_values(study, best, tr.metric.split("/", 1)[1])
    if saved is not None:
        split, x, w = saved
        se, n = standard_error(x, w), len(x)
        source = (
            f"per-example standard deviation over sqrt({n}), from the saved {split} predictions of "
            f"{best['trial_name']} at step {best['best_step']}"
        )
    elif tr.metric.split("/", 1)[1] in RATE_METRICS:
        n = tr.validation_sample_size
        se = rate_standard_error(float(best["best_metric"]), n)
        source = f"sqrt(p (1 - p) / {n}) at the best trial's p"
    else:
        return None
    return eval_noise(rows, tr.mode, tr.metric, n, se, source)


def _saved_values(study: Study, row: Mapping[str, Any], metric_name: str):
    """(split, per-example values, weights) of `metric_name` in the row's predictions at its
    best step -- the sample's (`validation-sample`), or the full set's (`validation`) where no
    sample file was written -- or None when neither file (or column) was saved."""
    from service.core import storage
    from service.core.tables import read_parquet
    from service.planning.trial import TrialPlan

    if row.get("best_step") is None:
        return None
    plan = TrialPlan(study, str(row["trial_name"]), str(row.get("round")))
    for split in ("validation-sample", "validation"):
        uri = plan.predictions_uri(split, int(row["best_step"]))
        if storage.exists(uri):
            table = read_parquet(storage.read_bytes(uri))
            column = f"metric/{metric_name}"
            if column not in table.column_names:
                return None
            return split, table[column].to_numpy(), table["weight"].to_numpy()
    return None


# ----------------------------------------------------------------------------- budget


def round_steps_spent(rows: list[dict], round_name: str) -> int:
    """Training steps a round's trials ran, as their rows record them (the last step each
    reached; steps an attempt repeated after a failure are not counted)."""
    return sum(int(r.get("step") or 0) for r in rows if r.get("round") == round_name)


def budget_spent(study: Study, round_name: str, rows: list[dict]) -> Verdict:
    """Round 1 against its share of the budget (`first_round_share * max_total_steps`): a
    warning when it spent more. Any later round: the rounds so far against the whole budget
    (a warning past it)."""
    budget = study.budget
    total = budget.max_total_steps
    names = [r.name for r in study.rounds]
    done = names[: names.index(round_name) + 1]
    spent = sum(round_steps_spent(rows, name) for name in done)
    facts = dict(spent=spent, max_total_steps=total, first_round_share=budget.round_one_share)
    if round_name == names[0]:
        share = budget.round_one_share * total
        said = (
            f"Round {round_name} spent {spent} of the budget's {total} training steps "
            f"({percent(spent / total)}); "
            f"its share is {percent(budget.round_one_share)} (budget.first_round_share)"
        )
        if spent > share:
            return make_verdict(
                "budget",
                round_name,
                WARNING,
                f"{said}: it spent more, leaving {max(0, total - spent)} steps for the longer rounds "
                "(compute-bound: round 1 short, round 2 longer).",
                **facts,
            )
        return make_verdict("budget", round_name, OK, f"{said}; {total - spent} steps remain.", **facts)
    said = f"The rounds up to {round_name} spent {spent} of the budget's {total} training steps"
    severity = WARNING if spent > total else OK
    return make_verdict("budget", round_name, severity, f"{said} ({percent(spent / total)}).", **facts)


# ----------------------------------------------------------------------------- validate


def validate_findings(study: Study) -> list[tuple[str, str, str]]:
    """What `playbook validate` says beyond errors, as (level, field, message), level
    `warning` or `note`: a round whose first evaluation comes after the first 10% of its
    training; the eval sample's largest standard error for a rate metric; a compute-bound
    round 1 planned over its share of the budget, or a later round that does not train longer
    than round 1; in a study that is not compute-bound, an exploration round whose
    max_train_steps differs from training.max_train_steps."""
    out = []
    tr = study.training
    for rnd in study.rounds:
        steps = study.round_steps(rnd)
        if not early_is_visible(tr.eval_every_steps, steps):
            first = min(tr.eval_every_steps, steps)
            out.append(
                (
                    "warning",
                    "training.eval_every_steps",
                    f"round {rnd.name}: the first evaluation is at step {first} of {steps} "
                    f"({percent(first / steps)}), after the first 10% of training, so a best checkpoint "
                    f"there cannot be seen (evaluate every {max(1, int(EARLY_FRACTION * steps))} "
                    "steps or fewer to see it)",
                )
            )
    if tr.validation_sample_size is not None:
        n = tr.validation_sample_size
        out.append(
            (
                "note",
                "training.validation_sample_size",
                f"a rate metric (such as an error rate) on {n} examples has a standard error of up to "
                f"{rate_standard_error(0.5, n):.3g} (sqrt(p (1 - p) / {n}) at p = 0.5); trials closer "
                "than that cannot be ranked (the round verdict eval_noise measures it)",
            )
        )
    if study.budget:
        out.extend(_budget_findings(study) if study.budget.compute_bound else _constant_steps(study))
    return out


def _constant_steps(study: Study) -> list[tuple[str, str, str]]:
    """Not compute-bound: one max_train_steps for every exploration round (extend rounds train
    the best configuration longer on purpose; repeat rounds as long as the trials they repeat)."""
    steps = study.training.max_train_steps
    return [
        (
            "warning",
            f"rounds[{i}].max_train_steps",
            f"round {rnd.name} trains {study.round_steps(rnd)} steps, not training.max_train_steps "
            f"{steps}: a study that is not compute-bound picks one max_train_steps (playbook find-steps) "
            "and uses it for every exploration round",
        )
        for i, rnd in enumerate(study.rounds)
        if rnd.kind not in ("extend", "repeat") and study.round_steps(rnd) != steps
    ]


def _budget_findings(study: Study) -> list[tuple[str, str, str]]:
    budget, rounds = study.budget, study.rounds
    out = []
    first = round_trials(study, rounds[0]) * study.round_steps(rounds[0])
    share = budget.round_one_share * budget.max_total_steps
    if first > share:
        out.append(
            (
                "warning",
                "budget.first_round_share",
                f"round {rounds[0].name} plans {first} training steps, more than its share "
                f"{percent(budget.round_one_share)} of budget.max_total_steps {budget.max_total_steps} "
                f"({math.floor(share)} steps)",
            )
        )
    first_steps = study.round_steps(rounds[0])
    for i, rnd in enumerate(rounds[1:], 1):
        if study.round_steps(rnd) <= first_steps:
            out.append(
                (
                    "warning",
                    f"rounds[{i}].max_train_steps",
                    f"round {rnd.name} trains {study.round_steps(rnd)} steps, not longer than round "
                    f"{rounds[0].name}'s {first_steps}: a compute-bound study's rounds grow "
                    "(round 1 short, round 2 longer)",
                )
            )
    return out
