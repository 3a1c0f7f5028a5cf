"""Each trial's warnings as short tags for its row of the report's trial table (the label
here, the sentence one click away): where its best checkpoint sits, input-bound, and its
training curves (`service.analysis.curves`, from its metrics log)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from service.analysis import curves
from service.analysis.input_bound import row_verdicts
from service.analysis.verdicts import Verdict, as_number, best_step_position, reached_best_step
from service.core.trial_status import TrialStatus
from service.report.load import StudyData

LABELS = {
    "input_bound": "input-bound",
    "late_noise": "noisy tail",
    "training_loss_rising": "loss rising",
    "clipping": "mostly clipped",
}
"""Short labels where the verdict's kind (underscores as spaces) is not one."""


@dataclass(frozen=True)
class Tag:
    label: str
    severity: str
    text: str
    """The verdict's whole sentence."""


def label(v: Verdict) -> str:
    if v.kind == "best_step_position":
        return f"best step {v.facts['position']}"
    return LABELS.get(v.kind, v.kind.replace("_", " "))


def row_warnings(data: StudyData, row: Mapping[str, Any]) -> list[Verdict]:
    """A trial's warnings: its best step's position (FINISHED), input-bound, its curves'."""
    out = []
    history = data.histories.get(str(row["trial_name"]), [])
    step, total = as_number(row.get("best_step")), as_number(row.get("max_train_steps"))
    if row.get("status") == TrialStatus.FINISHED and step is not None and total:
        reached = reached_best_step(row, history, data.metric, data.mode)
        out.append(best_step_position(str(row["trial_name"]), int(step), int(total), reached_step=reached))
    out += row_verdicts([row])
    out += curves.trial_verdicts(row, history, data.metric, data.mode, data.study.curves)
    return [v for v in out if v.is_warning]


def trial_tags(data: StudyData, row: Mapping[str, Any]) -> list[Tag]:
    return [Tag(label(v), v.severity, v.message) for v in row_warnings(data, row)]
