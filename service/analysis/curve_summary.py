"""A round's training-curve verdicts (`round_verdicts`), from its trials' (`service.analysis.curves`):
one verdict per kind that fired, naming its trials (the best ranked first) with the evidence of
the first; the best trial's clipping threshold; or one ok verdict when no curve warns. Each
rule as applied: docs/verdicts.md."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from service.analysis.curves import KINDS, NAMES_SHOWN, best_step, trial_curves, trial_verdicts
from service.analysis.eval_noise import RATE_METRICS
from service.analysis.optimization import clip_threshold
from service.analysis.verdicts import OK, WARNING, Verdict, make_verdict, percent, step_position
from service.core.formatting import trial_count
from service.core.ranking import ranked_results
from service.core.trial_status import TrialStatus
from service.study.sections import Curves


def round_verdicts(
    rows: Sequence[Mapping[str, Any]],
    histories: Mapping[str, Sequence[Mapping[str, Any]]],
    metric: str,
    mode: str,
    th: Curves,
) -> list[Verdict]:
    """A round's curve verdicts over its FINISHED trials with a metrics log and its DIVERGED
    ones: per kind that warned, one verdict naming its trials (best ranked first, then the
    rest by name); the best trial's clipping threshold; an ok verdict when nothing warned.
    Nothing for a round without such trials."""
    ranked = [str(r["trial_name"]) for r in ranked_results(rows, mode)]
    order = ranked + sorted(str(r["trial_name"]) for r in rows if str(r["trial_name"]) not in ranked)
    by_name = {str(r["trial_name"]): r for r in rows}
    judged = [n for n in order if _has_curves(by_name[n], histories.get(n))]
    if not judged:
        return []
    found = {n: trial_verdicts(by_name[n], histories.get(n, []), metric, mode, th) for n in judged}
    out = []
    for kind in KINDS:
        hits = [v for n in judged for v in found[n] if v.kind == kind and v.is_warning]
        if hits:
            out.append(_kind_summary(kind, hits, len(judged), ranked[0] if ranked else None))
    if not out:
        late = [n for n in judged if _best_is_late(by_name[n], histories.get(n, []), metric, mode)]
        rate = metric.rpartition("/")[2] in RATE_METRICS  # its evaluation's noise is known
        out.append(_all_clear(len(judged), late, ranked[0] if ranked else None, th, rate))
    best_clip = next((v for v in found.get(ranked[0], []) if v.kind == "clipping"), None) if ranked else None
    if best_clip is not None:
        out.append(clip_threshold(best_clip))
    return out


def _has_curves(row: Mapping[str, Any], history: Sequence[Mapping[str, Any]] | None) -> bool:
    """A trial the round judges: FINISHED with a metrics log, or DIVERGED (its row says where)."""
    status = row.get("status")
    return status == TrialStatus.DIVERGED or (status == TrialStatus.FINISHED and bool(history))


def _kind_summary(kind: str, hits: list[Verdict], judged: int, best: str | None) -> Verdict:
    """How many of the round's trials `kind` names, which (the round's best marked), and the
    first one's evidence. The kind itself is not in the message: the log line and the report
    show it beside the message (`round r: saturated_early: 1 of 6 trials: ...`)."""
    names = [v.subject for v in hits]
    shown = ", ".join(f"{n} (the best trial)" if n == best else n for n in names[:NAMES_SHOWN])
    more = f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else ""
    return make_verdict(
        kind,
        "study",
        WARNING,
        f"{len(hits)} of {trial_count(judged)}: {shown}{more}. {hits[0].message}",
        trials=tuple(names),
        num_trials=judged,
    )


def _best_is_late(
    row: Mapping[str, Any], history: Sequence[Mapping[str, Any]], metric: str, mode: str
) -> bool:
    """A FINISHED trial whose best value was first reached in the last 25% (`curves.best_step`,
    where `best_step_position` says "train longer")."""
    if row.get("status") != TrialStatus.FINISHED:
        return False
    t = trial_curves(row, history, metric, mode)
    return bool(t.metric.values) and step_position(best_step(t), t.max_train_steps) == "late"


def _all_clear(judged: int, late: list[str], best: str | None, th: Curves, rate: bool) -> Verdict:
    """No curve warned. A trial whose best value was first reached in the last 25% gained too
    little there for `still_improving`: said so, not "no late improvement" beside
    `best_step_position`'s "train longer" for it. (A best value reached before the last 25% and
    only equalled there is not late: `curves.best_step`.)"""
    rest = "early saturation, rising training loss, early instability or mostly clipped updates"
    if not late:
        return make_verdict(
            "training_curves",
            "study",
            OK,
            f"The training curves of the {trial_count(judged)} show no overfitting, late noise, late "
            f"improvement, {rest}.",
            num_trials=judged,
            late_best=(),
        )
    shown = ", ".join(f"{n} (the best trial)" if n == best else n for n in late[:NAMES_SHOWN])
    more = f" and {len(late) - NAMES_SHOWN} more" if len(late) > NAMES_SHOWN else ""
    curve = "their curves" if len(late) > 1 else "its curve"
    noise = " or no more than the evaluation's noise" if rate else ""
    return make_verdict(
        "training_curves",
        "study",
        OK,
        f"The training curves of the {trial_count(judged)} show no overfitting, late noise, {rest}. The best "
        f"checkpoint of {shown}{more} is in the last 25% of training, where {curve} "
        f"gained less than the still-improving threshold ({percent(th.still_improving)} of the whole "
        f"improvement over the last {percent(th.tail_fraction)}){noise}: best_step_position's "
        '"train longer" stands.',
        num_trials=judged,
        late_best=tuple(late),
    )
