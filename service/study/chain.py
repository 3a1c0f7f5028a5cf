"""A study's rounds as a chain: what each round changed relative to the one before it (its
kind, source, trials, steps, seed and search space) and why (its `reason`, which `playbook next`
writes). `playbook status` prints it and the report shows it as a table."""

from __future__ import annotations

from dataclasses import dataclass

from service.core.formatting import fmt, trial_count
from service.study.search import HParam, Round
from service.study.spec import Study


@dataclass(frozen=True)
class Link:
    """One round in the chain."""

    round: str
    kind: str
    num_trials: int
    steps: int
    source: str | None
    """The round it builds on (extend, bayesian, repeat), else None."""
    changes: tuple[str, ...]
    """What differs from the round before it, one phrase each (none for the first round)."""
    reason: str

    def line(self) -> str:
        """`explore-2: quasi_random, 16 trials x 300 steps; changed: ...; why: ...`"""
        source = f" from {self.source}" if self.source else ""
        text = f"{self.round}: {self.kind}{source}, {trial_count(self.num_trials)} x {self.steps} steps"
        if self.changes:
            text += "; changed: " + ", ".join(self.changes)
        return text + (f"; why: {self.reason}" if self.reason else "")


def chain(study: Study) -> list[Link]:
    """Every round of `study` in order, each against the one before it."""
    links, previous = [], None
    for rnd in study.rounds:
        source = study.source_round(rnd).name if rnd.kind in ("extend", "bayesian", "repeat") else None
        changes = () if previous is None else tuple(round_changes(study, previous, rnd))
        links.append(
            Link(rnd.name, rnd.kind, rnd.num_trials, study.round_steps(rnd), source, changes, rnd.reason)
        )
        previous = rnd
    return links


def round_changes(study: Study, before: Round, rnd: Round) -> list[str]:
    """What `rnd` does differently from `before`: kind, trials, steps, seed, search entries."""
    out = []
    if rnd.kind != before.kind:
        out.append(f"kind {before.kind} -> {rnd.kind}")
    if rnd.num_trials != before.num_trials:
        out.append(f"trials {before.num_trials} -> {rnd.num_trials}")
    steps = study.round_steps(before), study.round_steps(rnd)
    if steps[0] != steps[1]:
        times = f" (x{fmt(rnd.multiplier)})" if rnd.kind == "extend" and not rnd.max_train_steps else ""
        out.append(f"steps {steps[0]} -> {steps[1]}{times}")
    if rnd.kind == before.kind and rnd.seed != before.seed:
        out.append(f"seed {before.seed} -> {rnd.seed}")
    old, new = study.round_space(before), study.round_space(rnd)
    for name in [*old, *(n for n in new if n not in old)]:
        if old.get(name) != new.get(name):
            out.append(f"{name} {describe(old.get(name))} -> {describe(new.get(name))}")
    return out


def describe(hp: HParam | None) -> str:
    """A search entry in a few words: `fixed 16`, `nuisance [0.003, 1] log`, `scientific {8, 16}`."""
    if hp is None:
        return "(none)"
    if hp.role == "fixed" and hp.best_of is not None:
        return f"fixed at the best of round {hp.best_of}"
    if hp.role == "fixed":
        return f"fixed {fmt(hp.value)}"
    if hp.type == "choice":
        return f"{hp.role} {{{', '.join(fmt(v) for v in hp.values)}}}"
    scale = " log" if hp.scale == "log" else ""
    kind = " int" if hp.type == "int" else ""
    return f"{hp.role}{kind} [{fmt(hp.min)}, {fmt(hp.max)}]{scale}"
