"""The study's trial table: one row per trial, kept current while the study runs and written
to `<study>/trials.parquet` and `<study>/trials.csv` when a trial changes state (coalesced, see
`service.tracking.coalesce`: a rewrite costs O(rows), so one per event would cost O(trials^2) a study)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pyarrow as pa

from service.core import storage, tables
from service.study.layout import StudyLayout
from service.tracking.coalesce import Coalesced

COLUMNS = (
    "trial_name",
    "round",
    "status",
    "step",
    "max_train_steps",
    "metric",
    "best_metric",
    "best_step",
    "best_checkpoint",
    "error",
    "updated_at",
)


class TrialTable:
    def __init__(
        self,
        study_uri: str,
        metric: str,
        mode: str,
        on_save: Callable[[list[dict]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.study_uri, self.metric, self.mode = study_uri, metric, mode
        self.layout = StudyLayout(study_uri)
        self.on_save = on_save
        """Called with the rows after each write (the coordinator refreshes its study's index
        row and metrics there, at the same coalesced rate)."""
        self.rows: dict[str, dict] = {}
        self._lock = threading.Lock()
        self.writes = Coalesced(self._write, clock=clock)

    @property
    def parquet_uri(self) -> str:
        return self.layout.trials_parquet

    def load_existing(self) -> None:
        """Pick up the rows of an earlier, interrupted run of the same study."""
        if storage.exists(self.parquet_uri):
            table = tables.read_parquet(storage.read_bytes(self.parquet_uri))
            for row in table.to_pylist():
                self.rows[row["trial_name"]] = {k: v for k, v in row.items() if v is not None}

    def update(self, trial_name: str, **fields) -> dict:
        with self._lock:
            row = self.rows.setdefault(trial_name, {"trial_name": trial_name})
            row.update({k: v for k, v in fields.items() if v is not None})
            row["updated_at"] = time.time()
            return dict(row)

    def snapshot(self) -> list[dict]:
        with self._lock:
            return [dict(r) for r in self.rows.values()]

    def save(self) -> None:
        """Write the table now."""
        self.writes.flush()

    def save_soon(self) -> None:
        """A trial changed state: write the table now, or coalesced with the next changes."""
        self.writes.request()

    def _write(self) -> None:
        # Column by column, from references to the rows' values taken under the lock: no copy
        # of each row (a copy per row and write is O(rows) small objects per write, whose
        # churn next to the rows' own updates left the coordinator's heap fragmented).
        with self._lock:
            rows = list(self.rows.values())
            columns = tables.columns(rows, COLUMNS)
        if not rows:
            return
        table = pa.table(columns)
        del columns
        tables.write_parquet_csv(table, self.parquet_uri, self.layout.trials_csv)
        if self.on_save:
            self.on_save(rows)  # the live rows: read them, do not keep or change them


def read_rows(study_uri: str) -> list[dict]:
    uri = StudyLayout(study_uri).trials_parquet
    if not storage.exists(uri):
        return []
    return tables.read_parquet(storage.read_bytes(uri)).to_pylist()


def in_round_order(rows: list[dict]) -> list[dict]:
    """The rows round by round, in the order the rounds first appear in the table (the order
    they were planned and ran), each round's by trial name: what `playbook status` and the
    report list (by name alone, a round named `bayes` came before the `explore` it follows)."""
    first: dict = {}
    for r in rows:
        first.setdefault(r.get("round"), len(first))
    return sorted(rows, key=lambda r: (first[r.get("round")], str(r["trial_name"])))
