"""Everything a report shows, read from a study's storage: the stored study file, the trial
rows, each trial's rank-0 metrics log, the verdicts and the provenance record. One read per
trial, so loading is linear in the number of trials."""

from __future__ import annotations

import os
from dataclasses import dataclass

from service.core import storage
from service.core.errors import StudyNotFound
from service.study import spec
from service.study.layout import StudyLayout
from service.study.spec import Study
from service.study.stored import load_stored
from service.tracking import provenance, trial_table
from service.trainer import metrics_log


@dataclass(frozen=True)
class StudyData:
    study: Study
    study_uri: str
    rows: list[dict]
    """Trial rows (trials.parquet), sorted by trial name."""
    histories: dict[str, list[dict]]
    """Per trial, its evaluations in step order (metrics.jsonl; non-finite values are None)."""
    verdicts: list[dict]
    """verdicts.json: one summary per round, {"round", "verdicts": [...], "scientific"}."""
    provenance: dict

    @property
    def layout(self) -> StudyLayout:
        return StudyLayout(self.study_uri)

    @property
    def metric(self) -> str:
        return self.study.training.metric

    @property
    def mode(self) -> str:
        return self.study.training.mode


def study_uri_of(target: str) -> str:
    """A study file (local YAML) or a study URI (the folder holding study.yaml) -> study URI."""
    if os.path.isfile(target):
        from service.study.checks import resolve_paths

        return resolve_paths(spec.load_file(target)).study_uri
    return storage.absolute(target).rstrip("/")


def load(study_uri: str) -> StudyData:
    layout = StudyLayout(study_uri)
    study_file = layout.study_file
    if not storage.exists(study_file):
        raise StudyNotFound(f"{study_uri}: no stored study there (no study.yaml)")
    study = load_stored(study_uri)  # with the other studies' rounds it builds on
    rows = trial_table.in_round_order(trial_table.read_rows(study_uri))
    histories = {
        row["trial_name"]: metrics_log.read(layout.trial(row["trial_name"]).metrics_log) for row in rows
    }
    return StudyData(
        study=study,
        study_uri=study_uri,
        rows=rows,
        histories=histories,
        verdicts=storage.read_json(layout.verdicts, []),
        provenance=provenance.read(study_uri) or {},
    )
