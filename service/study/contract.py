"""The models the pre-flight contract check builds: the workload's model as this study's trials
will build it, not with the workload's defaults. A model that cannot read the data with some
value its trials take (an `lm` context shorter than the data's sequences) is refused before
anything starts, not in every trial.

The configurations are every combination of the values that bound what a trial takes of each
hyperparameter the workload's model reads (its `hparam_defaults`): its fixed value, each
choice, a range's two ends (`HParam.extremes`), in the study's `search:` and in each round's
(`Study.value_bounds`); past MAX_MODELS combinations, each value alone, the others at their
first."""

from __future__ import annotations

import itertools
import math

import pyarrow as pa

from service import workloads
from service.core.errors import SpecError
from service.core.formatting import fmt
from service.study.search import HParam
from service.study.spec import Study
from service.workloads.base import Workload

MAX_MODELS = 16


def model_configs(study: Study, workload: Workload) -> list[dict]:
    """The model hyperparameters to check the workload's contract with (see the module)."""
    values: dict[str, list] = {}
    for space in (study.search, *(study.value_bounds(r) for r in study.rounds)):
        for k, hp in space.items():
            seen = values.setdefault(k, []) if k in workload.hparam_defaults else []
            for v in hp.extremes:
                if typed(hp, v) not in seen:
                    seen.append(typed(hp, v))
    if math.prod(len(v) for v in values.values()) <= MAX_MODELS:
        return [dict(zip(values, combo, strict=True)) for combo in itertools.product(*values.values())]
    first = {k: v[0] for k, v in values.items()}
    return [{**first, k: v} for k, options in values.items() for v in options[1:]] + [first]


def typed(hp: HParam, value):
    """A range's end as a trial gets it: an int dimension's as an int."""
    return int(value) if hp.type == "int" else value


def check_contract_as_studied(study: Study, workload: Workload, table: pa.Table, where: str) -> None:
    """`workloads.check_contract` on `table` (the first rows of `where`) with each of the
    study's model configurations: one line naming the values a failing model was built with."""
    for hparams in model_configs(study, workload):
        try:
            workloads.check_contract(workload, table, hparams)
        except SpecError as e:
            if not hparams:  # the workload's own defaults: its contract, not this study's values
                raise
            values = ", ".join(f"{k}={fmt(v)}" for k, v in hparams.items())
            why = str(e).removeprefix(f"workload {workload.name}: ")
            raise SpecError(
                f"search: workload {workload.name}'s model with {values} (values this study's trials "
                f"take) fails on the first rows of {where}: {why}"
            ) from None
