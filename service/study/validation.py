"""The checks of a Study across its sections (each section checks its own fields in its
`errors()`): the study's name, round names and sources, hyperparameters the trainer would not
read, schedule lengths every round leaves room for, batch sizes that split over the workers,
ghost batch norm's virtual batches and microbatches, what fsdp cannot train. Each yields
(dotted path, message)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from service.study.search import CLIP_HPARAM, NAME_RE, READ_BY_OPTIMIZERS, SCHEDULE_HPARAMS, HParam
from service.study.training import Schedule, Training

if TYPE_CHECKING:
    from service.study.spec import Study


def study_errors(study: Study):
    """The errors of `study` across its sections (`Study.errors`, run after each section's own)."""
    if not NAME_RE.match(study.name):
        yield "name", f"must match {NAME_RE.pattern} (got {study.name!r})"
    if "learning_rate" not in study.search:
        yield "search", "must define learning_rate (searched or fixed)"
    if not study.rounds:
        yield "rounds", "must list at least one round"
    rounds = list(_round_errors(study))
    earlier = [*rounds, *_hparam_errors(study, with_rounds=not rounds)]
    yield from earlier
    if not earlier:  # the lengths need well-formed rounds and schedule hyperparameters
        yield from _schedule_length_errors(study)
    if study.training.batch_size % study.scaling.world_size:
        yield (
            "training.batch_size",
            (
                f"must be divisible by num_hosts * workers_per_host "
                f"({study.training.batch_size} % {study.scaling.world_size} != 0)"
            ),
        )
    if study.training.resolved_eval_batch_size % study.scaling.world_size:
        yield "training.eval_batch_size", "must be divisible by num_hosts * workers_per_host"
    if study.training.ghost_batch_norm:
        yield from _ghost_batch_errors(study.training, study.scaling.world_size)
    yield from _microbatch_errors(study.training, study.scaling.world_size)
    if study.scaling.strategy == "fsdp":
        yield from _fsdp_errors(study)


def _round_errors(study: Study):
    names = [r.name for r in study.rounds]
    for i, name in enumerate(names):
        if name in names[:i]:
            yield f"rounds[{i}].name", f"duplicate round name {name!r}"
    for name, hp in study.search.items():
        if hp.best_of is not None:
            yield f"search.{name}.best_of", "only in a round's search (it names an earlier round)"
    for i, r in enumerate(study.rounds):
        yield from _round_search_errors(study, i)
        if r.kind == "grid":
            dims = [hp for hp in study.round_space(r).values() if hp.searched]
            if any(hp.type != "choice" for hp in dims):
                yield f"rounds[{i}].kind", "grid needs every searched hyperparameter to be a choice"
            elif r.num_trials != math.prod(len(hp.values) for hp in dims):
                yield f"rounds[{i}].num_trials", "must equal the number of grid combinations"
        if r.kind not in ("extend", "bayesian", "repeat"):
            continue
        if r.from_other_study:
            yield from _other_study_errors(study, i)
        elif i == 0:
            what = "extend another round" if r.kind == "extend" else f"be {r.kind} (it needs a source)"
            yield f"rounds[{i}].kind", f"the first round cannot {what}"
        elif r.from_round is not None and r.from_round not in names[:i]:
            yield f"rounds[{i}].from_round", f"no earlier round named {r.from_round!r}"


def _other_study_errors(study: Study, i: int):
    """`from_round: other-study/round`: two names, the study not this one."""
    ref = study.rounds[i].from_round
    other, _, name = ref.partition("/")
    if not NAME_RE.match(other) or not NAME_RE.match(name):
        yield f"rounds[{i}].from_round", f"must be a round name or other-study/round (got {ref!r})"
    elif other == study.name:
        yield f"rounds[{i}].from_round", f"names this study: give the round alone ({name!r})"


def _round_search_errors(study: Study, i: int):
    """A round's own `search:` entries: an extend or repeat round's only fix values; `best_of`
    names an earlier round of this study whose space has the hyperparameter."""
    r, names = study.rounds[i], [x.name for x in study.rounds[:i]]
    for name, hp in r.search.items():
        where = f"rounds[{i}].search.{name}"
        if r.kind in ("extend", "repeat") and hp.searched:
            yield where, f"kind {r.kind} reruns configurations: its own entries may only be role fixed"
        if hp.best_of is None:
            continue
        if hp.best_of not in names:
            yield f"{where}.best_of", f"no earlier round named {hp.best_of!r}"
        elif name not in study.round_space(study.rounds[names.index(hp.best_of)]):
            yield f"{where}.best_of", f"round {hp.best_of} has no hyperparameter {name}"


def _hparam_errors(study: Study, with_rounds: bool = True):
    """`_space_errors` of the study's `search:` and (when its rounds are well formed) of each
    round's own entries, checked with the values they can take (`Study.value_bounds`)."""
    yield from _space_errors(study, study.search, study.search, "search")
    for i, r in enumerate(study.rounds if with_rounds else ()):
        yield from _space_errors(study, r.search, study.value_bounds(r), f"rounds[{i}].search")


def _space_errors(study: Study, entries: dict[str, HParam], bounds: dict[str, HParam], where: str):
    """A hyperparameter the trainer would not read: an optimizer's own one with another
    optimizer, a schedule field the schedule's kind has no use for (or one also set in
    training.schedule, which it would override). Schedule fields must be step counts or
    fractions."""
    tr, schedule = study.training, study.training.schedule
    for name in entries:
        hp = bounds[name]
        readers = READ_BY_OPTIMIZERS.get(name, (tr.optimizer,))
        if tr.optimizer not in (*readers, "workload"):
            yield (
                f"{where}.{name}",
                f"not read by optimizer {tr.optimizer} (only by {', '.join(readers)})",
            )
        if name in NUMBER_HPARAMS:
            yield from ((f"{where}.{name}", m) for m in _number_errors(hp, *NUMBER_HPARAMS[name]))
        if name not in SCHEDULE_HPARAMS:
            continue
        default = getattr(Schedule(), name)
        if getattr(schedule, name) != default:
            yield (
                f"{where}.{name}",
                f"also set in training.schedule.{name}, which this would override (set it in one place)",
            )
        if schedule.kind not in SCHEDULE_HPARAMS[name]:
            yield (
                f"{where}.{name}",
                f"not read by a {schedule.kind} schedule (training.schedule.kind; only by "
                f"{', '.join(SCHEDULE_HPARAMS[name])})",
            )
        yield from ((f"{where}.{name}", m) for m in _schedule_value_errors(name, hp))


def _schedule_length_errors(study: Study):
    """Every round leaves room for the longest warmup (and, linear, warmup + decay) any of
    its trials can get; an extend round of a linear schedule is at least as long as the
    trial it extends (the decay phase keeps its length). A round built on another study's
    is checked once that round is linked (`stored.link_rounds`)."""
    linear = study.training.schedule.kind == "linear"
    for i, r in enumerate(study.rounds):
        if study.unlinked(r):
            continue
        space = study.value_bounds(r)
        w_field, w = _longest(study, space, "warmup_steps", i)
        d_field, d = _longest(study, space, "decay_steps", i)
        steps = study.round_steps(r)
        derived = r.kind == "extend" and r.max_train_steps is None
        here = f"rounds[{i}].{'step_multiplier' if derived else 'max_train_steps'}"
        searched = [f for f in (w_field, d_field) if ".search." in f or f.startswith("search.")]
        if w >= steps:
            yield (
                w_field if w_field in searched else here,
                f"the longest warmup ({w}) must be < max_train_steps of round {r.name} ({steps})",
            )
        elif linear and d and w + d > steps:
            yield (
                " and ".join(searched) or here,  # both searched: either may be what is too long
                f"warmup + decay_steps (up to {w} + {d}) must be <= max_train_steps of round "
                f"{r.name} ({steps})",
            )
        elif linear and r.kind == "extend" and not d and steps < study.round_steps(study.source_round(r)):
            yield (
                here,
                (
                    f"round {r.name} ({steps} steps) is shorter than the round it extends "
                    f"({study.round_steps(study.source_round(r))}), whose linear decay it must keep"
                ),
            )


def _longest(study: Study, space: dict[str, HParam], name: str, i: int) -> tuple[str, int]:
    """The largest value of a schedule field the round's trials can get, and the field that
    sets it (the round's own search entry, the study's, or training.schedule)."""
    hp = space.get(name)
    if hp is None:
        return f"training.schedule.{name}", getattr(study.training.schedule, name) or 0
    where = f"rounds[{i}].search.{name}" if name in study.rounds[i].search else f"search.{name}"
    return where, max(int(v) for v in hp.extremes)


def _schedule_value_errors(name: str, hp: HParam):
    """warmup_steps and decay_steps are step counts (ints, decay > 0); final_lr_fraction is a
    number in [0, 1]."""
    if name in ("warmup_steps", "decay_steps"):
        if hp.searched and hp.type == "float":
            yield "a step count: must be type int or a choice of integers (type is float)"
            return
        values = hp.extremes
        if any(isinstance(v, bool) or not isinstance(v, int | float) or v != int(v) for v in values):
            yield f"a step count: every value must be an integer (got {', '.join(map(str, values))})"
            return
        low = 1 if name == "decay_steps" else 0
        if min(values) < low:
            yield f"must be >= {low} (got {min(values)})"
        return
    values = hp.extremes
    if any(isinstance(v, bool) or not isinstance(v, int | float) for v in values):
        yield f"must be a number (got {', '.join(map(str, values))})"
    elif not all(0 <= v <= 1 for v in values):
        yield f"a fraction of the base learning rate: must be in [0, 1] (got {', '.join(map(str, values))})"


FLOAT32_MAX = 3.4028234663852886e38
"""The largest float32. The optimizers multiply float32 weights by the learning rate and the
weight decay: torch refuses a factor above it ("cannot be converted to type float without
overflow") on every step of every trial."""

NUMBER_HPARAMS = {
    CLIP_HPARAM: ("a gradient norm", True, math.inf),
    "learning_rate": ("a learning rate", False, FLOAT32_MAX),  # 0 trains nothing: a baseline, or ties
    "weight_decay": ("a weight decay", False, FLOAT32_MAX),
}
"""Hyperparameters that must be numbers (finite: `HParam`'s own check): what each is, whether
it must be > 0 (else >= 0) and its largest value, as the optimizers accept them (torch refuses a
negative learning rate or weight decay)."""


def _number_errors(hp: HParam, what: str, positive: bool, largest: float):
    values = hp.extremes
    if any(isinstance(v, bool) or not isinstance(v, int | float) for v in values):
        yield f"{what}: must be a number (got {', '.join(map(str, values))})"
    elif min(values) < 0 or (positive and min(values) == 0):
        yield f"{what}: must be {'>' if positive else '>='} 0 (got {min(values)})"
    elif max(values) > largest:
        yield f"{what}: must be at most {largest:.4g}, the largest float32 (got {max(values):g})"


def ghost_batch_fits(batch_size: int, world_size: int, virtual_batch_size: int) -> bool:
    """Ghost batch norm's rule: statistics over exactly `virtual_batch_size` examples. Each
    worker's batch is a whole number of virtual batches, or the batches of a group of
    consecutive workers make one (a group size that divides the number of workers)."""
    per, v = batch_size // world_size, virtual_batch_size
    if batch_size % world_size:
        return False
    if per >= v:
        return per % v == 0
    return v % per == 0 and world_size % (v // per) == 0


def _microbatch_errors(training: Training, world: int):
    """training.microbatch_size must split each worker's batch (and, with ghost batch norm, be
    split into virtual batches itself)."""
    micro, per = training.microbatch_size, training.batch_size // world
    if micro is None or micro <= 0 or training.batch_size % world:
        return
    if per % micro:
        yield (
            "training.microbatch_size",
            f"must divide the per-worker batch {per} (batch_size {training.batch_size} over {world} "
            f"workers; {per} % {micro} != 0)",
        )
    elif training.ghost_batch_norm and micro % training.virtual_batch_size:
        yield (
            "training.microbatch_size",
            f"must be a multiple of virtual_batch_size {training.virtual_batch_size} with ghost_batch_norm",
        )


def _ghost_batch_errors(training: Training, world: int):
    batch_size, v = training.batch_size, training.virtual_batch_size
    if batch_size % world or ghost_batch_fits(batch_size, world, v):
        return
    per = batch_size // world
    if per > v:
        why = f"does not divide the per-worker batch of {per}"
    elif v % per:
        why = f"is not a whole number of per-worker batches of {per}"
    else:
        why = f"needs groups of {v // per} workers' batches of {per}, and {world} workers do not split so"
    sizes = [x for x in range(1, batch_size + 1) if ghost_batch_fits(batch_size, world, x)]
    batches = range(world, 2 * max(batch_size, v * world) + 1, world)
    yield (
        "training.virtual_batch_size",
        f"{v} {why} (training.batch_size {batch_size} over {world} workers); nearest that work: "
        f"virtual_batch_size {_nearest(sizes, v)}, or batch_size "
        f"{_nearest([b for b in batches if ghost_batch_fits(b, world, v)], batch_size)}",
    )


def _nearest(values: list[int], x: int) -> str:
    """The largest of `values` below x and the smallest above it."""
    return " or ".join(str(n) for n in [n for n in values if n < x][-1:] + [n for n in values if n > x][:1])


def _fsdp_errors(study: Study):
    """What `scaling.strategy: fsdp` cannot train (yet): fp16's loss scaling (its skipped steps
    would need every shard's overflow agreed; bf16 needs none) and a compiled model."""
    if study.training.precision == "fp16":
        yield "training.precision", "fp16 is not supported with scaling.strategy: fsdp (use bf16)"
    if study.training.compile:
        yield "training.compile", "not supported with scaling.strategy: fsdp"
