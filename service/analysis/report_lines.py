"""The playbook verdicts of a study as plain data and log lines (what the coordinator prints
after each round and saves to `<study>/verdicts.json`)."""

from __future__ import annotations

from service.analysis import curve_summary
from service.analysis.input_bound import row_verdicts
from service.analysis.round_checks import metrics_logs, verdicts_for_round
from service.analysis.scientific import best_per_scientific, summary_sentence
from service.analysis.seed_noise import repeat_sentence
from service.analysis.verdicts import Verdict
from service.core.formatting import fmt
from service.core.ranking import ranked_results
from service.study.spec import Study


def round_verdicts(study: Study, round_name: str, rows: list[dict]) -> dict:
    """The round's verdicts (`round_checks.verdicts_for_round`), its trials' input-bound ones,
    its training curves' and the scientific comparison. The trials' metrics logs are read once,
    for the best-step and the curve verdicts."""
    mine = [r for r in rows if r.get("round") == round_name]
    histories = metrics_logs(study, mine)
    verdicts = verdicts_for_round(study, round_name, rows, histories)
    verdicts += row_verdicts(mine)
    verdicts += curve_verdicts(study, mine, histories)
    rnd = next(r for r in study.rounds if r.name == round_name)
    space = study.compared_space(rnd)  # each round judged in its own search space
    groups = best_per_scientific(mine, space, study.training.mode)
    kind = rnd.kind
    if kind == "extend":
        sentence = repeats_sentence(mine, study.training.metric, study.training.mode)
    elif kind == "repeat":
        sentence = repeat_sentence(mine, space, study.training.metric, study.training.mode)
    else:
        sentence = summary_sentence(groups, study.training.metric) if groups else ""
    return {"round": round_name, "verdicts": [as_dict(v) for v in verdicts], "scientific": sentence}


def curve_verdicts(
    study: Study, rows: list[dict], histories: dict[str, list[dict]] | None = None
) -> list[Verdict]:
    """`curve_summary.round_verdicts` of these trial rows, their histories (by trial name) read
    from storage unless given."""
    histories = metrics_logs(study, rows) if histories is None else histories
    tr = study.training
    return curve_summary.round_verdicts(rows, histories, tr.metric, tr.mode, study.curves)


def repeats_sentence(rows: list[dict], metric: str, mode: str) -> str:
    """An extend round reruns one trial's configuration with different seeds: its best result
    is the best of that many seed repeats, e.g. "The best trial is exploit-0001 (seed 1,
    validation/error 0.02; best of 2 seed repeats of explore-0003, seeds 0, 1)"."""
    done = ranked_results(rows, mode)
    if not done:
        return ""
    best, n = done[0], len(done)
    source = ", ".join(sorted({str(r["extended_from"]) for r in rows if r.get("extended_from")}))
    seeds = ", ".join(fmt(s) for s in sorted(r["seed"] for r in done if r.get("seed") is not None))
    of = f"best of {n} seed repeats" if n > 1 else "the only finished seed repeat"
    return (
        f"The best trial is {best['trial_name']} (seed {fmt(best.get('seed'))}, {metric} "
        f"{fmt(best['best_metric'])}; {of} of {source or 'one configuration'}, "
        f"seed{'s' if n > 1 else ''} {seeds or '-'})"
    )


def as_dict(v: Verdict) -> dict:
    return {"kind": v.kind, "subject": v.subject, "severity": v.severity, "message": v.message}


def log_lines(summary: dict) -> list[str]:
    lines = [f"round {summary['round']}: {summary['scientific']}"] if summary["scientific"] else []
    for v in summary["verdicts"]:
        if v["severity"] == "warning":
            lines.append(f"round {summary['round']}: {v['kind']}: {v['message']}")
    if len(lines) == (1 if summary["scientific"] else 0):
        lines.append(f"round {summary['round']}: no playbook warnings")
    return lines
