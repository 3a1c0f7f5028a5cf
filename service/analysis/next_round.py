"""`playbook next`: the round a finished round's verdicts call for, as values; no I/O.

`propose(study, round_name, rows, verdicts)` reads the round's verdicts (as `Verdict` values,
with their data) and its trial rows, and returns a `Proposal`: the fields of one round to
append to the study's `rounds:`, each with the verdict that motivates it, plus notes on what
a round cannot carry. The rules (docs/study-file.md#the-next-round-playbook-next):

* `boundary` (the best trial near a bound of a nuisance dimension; the playbook: "check
  whether the best learning rate is at the boundary of the search space") -> that range widened
  on its side, as `widening` says; not a bound past which every trial diverged
  (`infeasible_region`: the feasible region ends there, a note says so);
* `enough_trials` warning -> the same kind of round again with `MORE_TRIALS_FACTOR` times the
  trials (at least `MIN_TRIALS`), new quasi-random points (its seed + 1);
* `clipping` warning (most updates clipped), or `early_instability` in a study that does not
  clip -> `grad_clip_norm` fixed at the round's suggested threshold (`clip_threshold`) in the
  round's `search:` (after an extend or repeat round: on the extend round below);
* these change the search and come first: the playbook settles the search space before it
  trains longer. Without them, best checkpoints late (`best_step_distribution`: most of the
  trials, or of the top quarter, in the last 25%, each judged at the step where it first
  reached its best value, so a plateau that began earlier is not late) -> an `extend` round of
  the best trial with `step_multiplier` `DEFAULT_STEP_MULTIPLIER` (the playbook's rounds grow
  their length exponentially), less when a compute-bound budget leaves less;
* a `repeat` round whose best scientific value beats the next beyond seed noise (Welch's test,
  `seed_noise`) -> that value fixed, and the nuisance hyperparameters explored again around it;
* `input_bound` -> the input change its cause names, as a note: `input:` is the study's
  section, not a round's (a rerun may change its run-only fields);
* nothing of these -> an empty proposal ("nothing to act on").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.analysis.enough_trials import MIN_TRIALS
from service.analysis.round_checks import round_steps_spent
from service.analysis.seed_noise import ALPHA, welch
from service.analysis.verdicts import Verdict
from service.analysis.widening import widenings
from service.core.formatting import fmt, trial_count
from service.core.ranking import results, sign
from service.study.rounds_text import hparam_dict, scalar
from service.study.search import CLIP_HPARAM, DEFAULT_STEP_MULTIPLIER, NAME_RE, HParam, Round
from service.study.spec import Study

MORE_TRIALS_FACTOR = 2
"""Too few trials: the next round runs this many times the trials of the one judged."""
EXTEND_TRIALS = 2
"""Trials of an extend round that follows an exploration round (seed repeats of its best)."""
EXPLORATION = ("quasi_random", "grid", "bayesian")


@dataclass(frozen=True)
class Field:
    """One key of the proposed round, its value and why (the verdict behind it, or '')."""

    key: str
    value: Any
    why: str = ""


@dataclass(frozen=True)
class Proposal:
    after: str
    """The round whose verdicts it reads."""
    fields: tuple[Field, ...] = ()
    """The round's keys in the order they are written; none: no round to add."""
    search: tuple[Field, ...] = ()
    """The round's own `search:` entries (`HParam` values)."""
    notes: tuple[str, ...] = ()
    """What the round cannot carry: study-level changes, verdicts left for a later round."""

    @property
    def empty(self) -> bool:
        return not self.fields

    def round_dict(self) -> dict:
        """The round as plain data (what the study file's YAML parses to)."""
        out = {f.key: f.value for f in self.fields if f.key != "reason"}
        if self.search:
            out["search"] = {f.key: hparam_dict(f.value) for f in self.search}
        out.update({f.key: f.value for f in self.fields if f.key == "reason"})
        return out


def propose(study: Study, round_name: str, rows: list[dict], verdicts: list[Verdict]) -> Proposal:
    """The round that `round_name`'s verdicts call for (`rows`: the study's trial rows)."""
    rnd = next(r for r in study.rounds if r.name == round_name)
    mine = [r for r in rows if r.get("round") == round_name]
    notes = tuple(input_note(v, study) for v in verdicts if v.kind == "input_bound" and v.is_warning)
    if rnd.kind == "repeat":
        fixed = winner_fixed(study, rnd, mine)
        if fixed:
            return explore_again(study, rnd, fixed, (), notes)
    if rnd.kind in EXPLORATION:
        space = study.compared_space(rnd)
        widened, unwidened = widenings(verdicts, space)
        widened = tuple(Field(*w) for w in widened)
        search, notes = widened + clip_entries(verdicts, space), notes + unwidened
        more = more_trials(rnd, verdicts)
        if search or more:
            late = late_majority(verdicts)
            later = ("best checkpoints late: extend once the search space is settled",) if late else ()
            return explore_again(study, rnd, search, more, notes + later)
    late = late_majority(verdicts)
    if late:  # after an extend or repeat round, a clipping verdict rides along (its entries fix values)
        return extend(study, rnd, rows, late, clip_entries(verdicts, study.round_space(rnd)), notes)
    return Proposal(round_name, notes=notes)


# ----------------------------------------------------------------------------- rounds


def explore_again(
    study: Study, rnd: Round, search: tuple[Field, ...], more: tuple[Field, ...], notes: tuple[str, ...]
) -> Proposal:
    """A round like `rnd` (the exploration round a repeat round repeats, for a repeat round)
    over the changed space: `rnd`'s own search entries carried, `search` in their place."""
    base = study.source_round(rnd) if rnd.kind == "repeat" else rnd
    while base.kind not in EXPLORATION:
        base = study.source_round(base)
    kind = base.kind
    own = {k: Field(k, v, f"as in round {base.name}") for k, v in base.search.items()}
    own.update({f.key: f for f in search})
    space = {**study.round_space(base), **{k: f.value for k, f in own.items()}}
    fields = [Field("name", next_name(study, base.name), f"after round {rnd.name}")]
    fields.append(Field("kind", kind, f"as round {base.name}"))
    if kind == "grid":
        combos = math.prod(len(hp.values) for hp in space.values() if hp.searched)
        fields.append(Field("num_trials", combos, "every combination of the choices"))
    else:
        fields.append(more[0] if more else Field("num_trials", base.num_trials, f"as round {base.name}"))
        fields.append(
            Field("seed", base.seed + 1, f"new points (round {base.name} drew with seed {base.seed})")
        )
    if kind == "bayesian":
        fields.append(Field("from_round", rnd.name, "warm-started with its trials"))
    if base.max_train_steps:
        fields.append(Field("max_train_steps", base.max_train_steps, f"as round {base.name}"))
    why = [f.why for f in (*search, *more)]
    fields.append(Field("reason", f"playbook next after round {rnd.name}: " + "; ".join(why)))
    return Proposal(rnd.name, tuple(fields), tuple(own.values()), notes)


def extend(
    study: Study, rnd: Round, rows: list[dict], late: str, search: tuple[Field, ...], notes: tuple[str, ...]
) -> Proposal:
    """An extend round of `rnd`'s best trial, `DEFAULT_STEP_MULTIPLIER` times as long (less
    when a compute-bound budget leaves less; none when it leaves no longer round), with the
    values `search` fixes on top of that trial's configuration."""
    trials = rnd.num_trials if rnd.kind in ("extend", "repeat") else EXTEND_TRIALS
    steps = study.round_steps(rnd)
    multiplier, why = DEFAULT_STEP_MULTIPLIER, "the playbook's rounds grow their length exponentially"
    budget = study.budget
    if budget and budget.compute_bound and budget.max_total_steps:
        left = budget.max_total_steps - sum(round_steps_spent(rows, r.name) for r in study.rounds)
        affordable = math.floor(100 * left / (trials * steps)) / 100
        if affordable <= 1:
            short = (
                f"{late}, but the budget has {left} steps left: no longer round of {trial_count(trials)} fits"
            )
            return Proposal(rnd.name, notes=(*notes, short))
        if affordable < multiplier:
            multiplier, why = affordable, f"what the budget's {left} steps left allow"
    base = rnd.name if rnd.kind == "extend" else "extend"
    fields = (
        Field("name", next_name(study, base), f"after round {rnd.name}"),
        Field("kind", "extend", late),
        Field("from_round", rnd.name, f"its best trial, {steps} steps"),
        Field("num_trials", trials, "seed repeats of it"),
        Field("step_multiplier", multiplier, f"{fmt(steps * multiplier)} steps: {why}"),
        Field(
            "reason", f"playbook next after round {rnd.name}: " + "; ".join([late, *(f.why for f in search)])
        ),
    )
    return Proposal(rnd.name, fields, search, notes)


def next_name(study: Study, base: str) -> str:
    """`base` without a trailing `-<n>`: itself when no round has that name, else numbered from
    2 past every round name in the study."""
    stem = base.rsplit("-", 1)[0] if base.rsplit("-", 1)[-1].isdigit() else base
    if not NAME_RE.match(f"{stem}-2"):  # another study's `study/round`, or too long
        stem = "round"
    names = {r.name for r in study.rounds}
    if stem not in names:
        return stem
    n = 2
    while f"{stem}-{n}" in names:
        n += 1
    return f"{stem}-{n}"


# ----------------------------------------------------------------------------- rules


def late_majority(verdicts: list[Verdict]) -> str:
    """'' unless most of the round's trials (or of its top quarter) have their best checkpoint
    in the last 25% of training and most are not in the first 10%; else a phrase that says so."""
    spread = next((v.facts for v in verdicts if v.kind == "best_step_distribution"), None)
    if spread is None:
        return ""
    n, k = spread["num_trials"], spread["top_trials"]
    if spread["early"] * 2 > n or spread["top_early"] * 2 > k:
        return ""
    if spread["late"] * 2 > n or spread["top_late"] * 2 > k:
        late, top = spread["late"], spread["top_late"]
        return (
            f"best checkpoints late: {late} of {trial_count(n)} ({top} of the best {k}) in the last 25% of "
            "training"
        )
    return ""


def more_trials(rnd: Round, verdicts: list[Verdict]) -> tuple[Field, ...]:
    """`num_trials` for a round whose `enough_trials` warned (not a grid: its trials are its
    combinations)."""
    v = next((v for v in verdicts if v.kind == "enough_trials" and v.is_warning), None)
    if v is None or rnd.kind == "grid":
        return ()
    n = v.facts["num_trials"]
    trials = max(MORE_TRIALS_FACTOR * rnd.num_trials, MIN_TRIALS)
    said = f"fewer than {MIN_TRIALS}" if v.facts.get("reason") == "few_trials" else "the best rests on luck"
    return (Field("num_trials", trials, f"enough_trials: {n} finished, {said}: {trials} trials"),)


def clip_entries(verdicts: list[Verdict], space: Mapping[str, HParam]) -> tuple[Field, ...]:
    """`grad_clip_norm` fixed at the round's suggestion when most updates of a trial were
    clipped, or training was unstable early and nothing clips."""
    suggestion = next((v for v in verdicts if v.kind == "clip_threshold"), None)
    if suggestion is None:
        return ()
    clip = float(f"{suggestion.facts['suggested_clip']:.4g}")
    clipped = next((v for v in verdicts if v.kind == "clipping" and v.is_warning), None)
    unstable = next((v for v in verdicts if v.kind == "early_instability" and v.is_warning), None)
    if clipped is not None:
        why = f"clipping: most updates of {', '.join(clipped.facts['trials'])} clipped: raised to"
    elif unstable is not None and CLIP_HPARAM not in space:
        why = f"early_instability in {', '.join(unstable.facts['trials'])}: clip at"
    else:
        return ()
    why += (
        f" the suggested {fmt(clip)} (90th percentile of {suggestion.facts['trial_name']}'s gradient norms)"
    )
    return (Field(CLIP_HPARAM, HParam(role="fixed", value=clip), why),)


def winner_fixed(study: Study, rnd: Round, rows: list[dict]) -> tuple[Field, ...]:
    """The scientific values of a repeat round's best mean, fixed, when they beat the next
    best beyond seed noise (Welch's p < ALPHA over 2+ repeats each; with no seed noise on
    either side, any difference)."""
    space = study.compared_space(rnd)
    names = [k for k, hp in space.items() if hp.role == "scientific"]
    groups: dict[tuple, list[float]] = {}
    for row in sorted(results(rows), key=lambda r: r["trial_name"]):
        groups.setdefault(tuple(row.get(f"hp/{k}") for k in names), []).append(float(row["best_metric"]))
    ranked = sorted(groups.items(), key=lambda g: sign(study.training.mode) * float(np.mean(g[1])))
    if not names or len(ranked) < 2 or min(len(ranked[0][1]), len(ranked[1][1])) < 2:
        return ()
    (best, a), (other, b) = ranked[0], ranked[1]
    if np.ptp(a) == 0 and np.ptp(b) == 0:
        if a[0] == b[0]:
            return ()
        said = "every seed of each gave the same result"
    else:
        p = welch(a, b)[2]
        if not p < ALPHA:
            return ()
        said = f"Welch's p = {fmt(p)} < {ALPHA}"
    label = ", ".join(f"{k}={fmt(v)}" for k, v in zip(names, other, strict=True))
    return tuple(
        Field(k, HParam(role="fixed", value=v), f"seed noise: {k}={fmt(v)} beats {label} ({said}): fixed")
        for k, v in zip(names, best, strict=True)
    )


def input_note(v: Verdict, study: Study) -> str:
    """The input change an `input_bound` warning's cause names: a setting of the study's
    `input:` section (twice its value where raising it is the cure) or what to do outside it."""
    prefetch, workers = study.input.prefetch_batches, study.input.num_input_workers
    change = {
        "prefetch_too_shallow": f"set input.prefetch_batches: {2 * prefetch} (now {prefetch})",
        "input_workers": f"set input.num_input_workers: {2 * workers} (now {workers})",
        "online_augmentation": "set input.workers: processes",
        "online_preprocessing": "run `playbook preprocess` offline, or set input.workers: processes",
        "online_decoding": "decode offline with `playbook preprocess`, or set input.workers: processes",
        "unused_columns": "drop the unused columns from the workload's declared columns",
        "remote_io": "cache the data on local disk or colocate it with the cluster",
        "slow_reads": "put the data on faster disk or write fewer, larger row groups",
    }.get(v.facts.get("cause", ""), "see its verdict")
    return f"input_bound: {v.subject} waits {v.facts.get('exposed_fraction', 0):.0%} of its steps: {change}"


def as_yaml(p: Proposal, indent: int = 2) -> str:
    """The proposal as lines to append to `rounds:` (items at `indent` spaces), each commented
    with its reason; nothing to act on: comment lines that say so."""
    pad = " " * indent
    head = f"{pad}# playbook next: the round the verdicts of round {p.after} call for"
    lines: list[tuple[str, str]] = []
    for i, f in enumerate(f for f in p.fields if f.key != "reason"):
        lines.append((f"{pad}{'- ' if i == 0 else '  '}{f.key}: {scalar(f.value)}", f.why))
    if p.search:
        lines.append((f"{pad}  search:", ""))
        lines += [(f"{pad}    {f.key}: {scalar(hparam_dict(f.value))}", f.why) for f in p.search]
    lines += [(f"{pad}  reason: {scalar(f.value)}", "") for f in p.fields if f.key == "reason"]
    width = max((len(text) for text, why in lines if why), default=0)
    body = [f"{text.ljust(width)}  # {why}" if why else text for text, why in lines]
    notes = [f"{pad}# note: {n}" for n in p.notes]
    if p.empty:
        return (
            "\n".join([f"{pad}# playbook next: nothing to act on in the verdicts of round {p.after}", *notes])
            + "\n"
        )
    return "\n".join([head, *body, *notes]) + "\n"
