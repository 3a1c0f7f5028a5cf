"""The playbook verdicts of a study as plain data and log lines (what the coordinator prints
after each round and saves to `<study>/verdicts.json`)."""

from __future__ import annotations

from service.analysis.input_bound import row_verdicts
from service.analysis.round_checks import verdicts_for_round
from service.analysis.scientific import best_per_scientific, summary_sentence
from service.analysis.verdicts import Verdict
from service.spec import Study


def round_verdicts(study: Study, round_name: str, rows: list[dict]) -> dict:
    """The round's verdicts (`round_checks.verdicts_for_round`), its trials' input-bound ones
    and the scientific comparison."""
    mine = [r for r in rows if r.get("round") == round_name]
    verdicts = verdicts_for_round(study, round_name, rows)
    verdicts += row_verdicts(mine)
    groups = best_per_scientific(mine, study.search, study.training.mode)
    return {
        "round": round_name,
        "verdicts": [as_dict(v) for v in verdicts],
        "scientific": summary_sentence(groups, study.training.metric) if groups else "",
    }


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
