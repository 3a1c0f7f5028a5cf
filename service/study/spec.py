"""The study file: YAML -> frozen dataclasses. Defaults live with each section's dataclass and
nowhere else: `training.py` (data:, scaling:, training:), `search.py` (search:, rounds:) and
`sections.py` (input:, find_steps:, tracking:, budget:, curves:). This module assembles them
into the `Study` and reads and writes study files; `validation.py` checks across sections.

The loader is strict: an unknown key, a missing required key, a wrong type or an impossible
value raises `SpecError` whose message starts with the dotted path of the field, e.g.
``training.eval_every_steps: must be > 0 (got 0)``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import yaml

from service.core import storage
from service.core.errors import SpecError
from service.study.layout import StudyLayout
from service.study.search import DEFAULT_STEP_MULTIPLIER, HParam, Round
from service.study.sections import Budget, Curves, FindSteps, InputPipeline, Tracking
from service.study.strict import Scalar, build, load_yaml
from service.study.training import Data, Scaling, Schedule, Training
from service.study.validation import study_errors


@dataclass(frozen=True)
class Study:
    name: str
    """Study name: lower-case letters, digits, '-' and '_'. Names the coordinator and storage."""
    workload: str
    """Built-in workload name (`digits`, `digits_zero`) or `package.module:Class`."""
    data: Data
    """Where the data lives."""
    training: Training
    """How every trial trains and evaluates."""
    search: dict[str, HParam]
    """The hyperparameters, each with its role; `learning_rate` is required."""
    rounds: tuple[Round, ...]
    """The rounds, run in order."""
    storage: str = "./playbook-studies"
    """Root URI for checkpoints, metrics and tracking (local path, gs://...); the study writes
    under `<storage>/<name>/`. Relative paths are resolved against the working directory."""
    description: str = ""
    """What this study is for (goes to the tracking table)."""
    scaling: Scaling = field(default_factory=Scaling)
    """Hosts and workers per trial."""
    find_steps: FindSteps | None = None
    """Settings of `playbook find-steps` (the max_train_steps finder)."""
    input: InputPipeline = field(default_factory=InputPipeline)
    """The input pipeline: prefetch depth, shuffle window, input-bound threshold, profiling."""
    tracking: Tracking = field(default_factory=Tracking)
    """Progress lines and the optional MLflow mirror."""
    budget: Budget | None = None
    """Compute-bound or not, and the compute-bound study's budget (unset: not said)."""
    curves: Curves = field(default_factory=Curves)
    """Thresholds of the training-curve verdicts (overfitting, late noise, still improving, ...)."""
    linked: tuple[Round, ...] = field(default=(), metadata={"in_file": False})
    """Not in a study file: the rounds of other studies that a `from_round: other-study/round`
    names, each as a Round named `other-study/round` with its max_train_steps as that study
    ran it (`service.study.stored.link_rounds` reads them from the storage root)."""

    def errors(self):
        yield from study_errors(self)

    def round_steps(self, rnd: Round) -> int:
        """max_train_steps of a round: its override, else (extend) the source round's times
        step_multiplier, else training.max_train_steps."""
        if rnd.max_train_steps:
            return rnd.max_train_steps
        if rnd.kind == "extend":
            return max(1, round(self.round_steps(self.source_round(rnd)) * rnd.multiplier))
        if rnd.kind == "repeat":
            return self.round_steps(self.source_round(rnd))
        return self.training.max_train_steps

    def source_round(self, rnd: Round) -> Round:
        """The round `rnd` builds on: its from_round (a round of this study, or a linked one of
        another study), else the round before it."""
        i = self.rounds.index(rnd)
        name = rnd.from_round or self.rounds[i - 1].name
        found = next((r for r in (*self.rounds, *self.linked) if r.name == name), None)
        if found is None:  # only a study whose rounds were not linked (stored.link_rounds)
            raise SpecError(f"rounds[{i}].from_round: round {name!r} of another study is not linked")
        return found

    def unlinked(self, rnd: Round) -> bool:
        """`rnd` builds on another study's round that this Study does not know yet."""
        return rnd.from_other_study and rnd.from_round not in {r.name for r in self.linked}

    def round_space(self, rnd: Round) -> dict[str, HParam]:
        """The search space of one round: the study's `search:` with the round's own entries
        over it (a fixed `best_of` entry is resolved from trial rows by the planner)."""
        return {**self.search, **rnd.search}

    def compared_space(self, rnd: Round) -> dict[str, HParam]:
        """The space a round's results are judged in (verdicts, scientific comparison): its own,
        but a repeat round's is that of the round it repeats (in this study), whose scientific
        values it reruns."""
        if rnd.kind == "repeat" and not rnd.from_other_study:
            return self.compared_space(self.source_round(rnd))
        return self.round_space(rnd)

    def value_bounds(self, rnd: Round) -> dict[str, HParam]:
        """`round_space`, each `best_of` entry replaced by the entry of the round it names
        (whose trials' values bound what its best trial took)."""
        space = self.round_space(rnd)
        for name, hp in space.items():
            if hp.best_of is not None:
                space[name] = self.value_bounds(next(r for r in self.rounds if r.name == hp.best_of))[name]
        return space

    @property
    def searched_hparams(self) -> dict[str, HParam]:
        return {k: v for k, v in self.search.items() if v.searched}

    @property
    def fixed_hparams(self) -> dict[str, Scalar]:
        return {k: v.value for k, v in self.search.items() if not v.searched}

    @property
    def layout(self) -> StudyLayout:
        """Where this study's files are on storage."""
        return StudyLayout.of(self.storage, self.name)

    @property
    def study_uri(self) -> str:
        return self.layout.uri


# ----------------------------------------------------------------------------- loading


def load_file(path: str | os.PathLike) -> Study:
    """Read and validate a study file. Raises SpecError naming the file or the field."""
    try:
        if "://" in str(path):  # a stored study file (gs://..., the reproduction command's)
            text = storage.read_bytes(str(path)).decode("utf-8")
        else:
            with open(path, encoding="utf-8") as f:
                text = f.read()
    except OSError as e:
        raise SpecError(f"{path}: cannot read study file ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise SpecError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    return load_text(text, source=str(path))


def load_text(text: str, source: str = "<study>") -> Study:
    return load_dict(load_yaml(text, source))


def load_dict(raw: dict) -> Study:
    return build(Study, _without_old_round_defaults(raw), "")


def _without_old_round_defaults(raw):
    """A study file stored by an earlier version lists every field of every round, with
    `from_round: null` and `step_multiplier: 2.0` where that was the default of a field the
    round does not read; it is dropped here, so a stored study still loads (a study file
    written by hand, without `from_round: null`, is checked as written)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("rounds"), list):
        return raw
    rounds = []
    for r in raw["rounds"]:
        if isinstance(r, dict) and "from_round" in r and r["from_round"] is None:
            unread = r.get("kind", "quasi_random") != "extend" or r.get("max_train_steps") is not None
            if unread and r.get("step_multiplier") == DEFAULT_STEP_MULTIPLIER:
                r = {k: v for k, v in r.items() if k != "step_multiplier"}
        rounds.append(r)
    return {**raw, "rounds": rounds}


def schedule_from_dict(raw: dict) -> Schedule:
    return build(Schedule, raw, "schedule")


def to_dict(study: Study) -> dict:
    """Plain data (lists, dicts, scalars) that `load_dict` turns back into an equal Study."""

    def plain(v):
        if isinstance(v, tuple | list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    out = plain(dataclasses.asdict(study))
    return {f.name: out[f.name] for f in dataclasses.fields(study) if f.metadata.get("in_file", True)}


def dump_yaml(study: Study) -> str:
    return yaml.safe_dump(to_dict(study), sort_keys=False)


def with_overrides(study: Study, **changes) -> Study:
    return dataclasses.replace(study, **changes)
