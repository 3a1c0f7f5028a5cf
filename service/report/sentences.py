"""The report's plain sentences: the playbook verdicts saved after each round (any kind, so
verdicts added later -- input-bound, say -- show up without changes here), the divergences
and the eval-sample bias found in the metrics logs."""

from __future__ import annotations

from dataclasses import dataclass

from service.core.formatting import fmt
from service.core.trial_status import TrialStatus
from service.report.load import StudyData

STUDY = "study"
"""The section of the sentences about all the study's trials (divergences, eval-sample bias):
the kind says which, so a line reads `study: divergence: ...`, not the kind twice."""


@dataclass(frozen=True)
class Sentence:
    section: str
    """Where it applies: `round <name>` or `study` (all trials)."""
    kind: str
    severity: str
    """`ok` or `warning`."""
    text: str


def verdict_sentences(data: StudyData) -> list[Sentence]:
    out = []
    for summary in data.verdicts:
        section = f"round {summary.get('round')}"
        if summary.get("scientific"):
            out.append(Sentence(section, "scientific", "ok", summary["scientific"]))
        for v in summary.get("verdicts", []):
            out.append(
                Sentence(section, str(v.get("kind")), str(v.get("severity", "ok")), str(v.get("message")))
            )
    return out


def divergence_sentences(data: StudyData) -> list[Sentence]:
    diverged = [r for r in data.rows if r.get("status") == TrialStatus.DIVERGED]
    if not diverged:
        return [Sentence(STUDY, "divergence", "ok", f"No trial diverged ({len(data.rows)} trials).")]
    out = []
    for r in diverged:
        hps = ", ".join(
            [f"{k.removeprefix('hp/')}={fmt(v)}" for k, v in sorted(r.items()) if k.startswith("hp/")]
            + ([f"seed={fmt(r['seed'])}"] if r.get("seed") is not None else [])
        )
        at = r.get("diverged_at_step")
        out.append(
            Sentence(
                STUDY,
                "divergence",
                "warning",
                f"Trial {r['trial_name']} diverged (non-finite training loss)"
                + (f" at step {at}" if at is not None else "")
                + (f" with {hps}." if hps else "."),
            )
        )
    return out


def bias_sentences(data: StudyData) -> list[Sentence]:
    """Where a fixed validation sample was checked against the full set: biased checks name
    the trial, step and gap; otherwise one sentence says how many checks were within noise."""
    checks, biased = 0, []
    for trial, history in data.histories.items():
        for h in history:
            if "validation_full/sample_biased" not in h:
                continue
            checks += 1
            if h["validation_full/sample_biased"]:
                biased.append((trial, h))
    if not checks:
        return []
    out = [
        Sentence(
            STUDY,
            "eval_sample_bias",
            "warning",
            f"Trial {t}: at step {h['step']} the validation sample's {data.metric} differs from the "
            f"full set's by {fmt(h.get('validation_full/sample_gap'))} (95% CI "
            f"[{fmt(h.get('validation_full/sample_gap_ci_low'))}, "
            f"{fmt(h.get('validation_full/sample_gap_ci_high'))}]), more than sampling noise explains.",
        )
        for t, h in biased
    ]
    if not biased:
        out.append(
            Sentence(
                STUDY,
                "eval_sample_bias",
                "ok",
                f"The validation sample agreed with the full validation set within sampling noise "
                f"at all {checks} full evaluations.",
            )
        )
    return out


def all_sentences(data: StudyData) -> list[Sentence]:
    return verdict_sentences(data) + divergence_sentences(data) + bias_sentences(data)
