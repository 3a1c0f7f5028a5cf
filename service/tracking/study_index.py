"""The storage root's tracking table: one row per study, in `<storage>/studies.parquet` and
`<storage>/studies.csv` (the playbook's study spreadsheet).

Several studies may share one storage root and write at the same time, on a local disk or on
an object store, where there is no file lock and no atomic append. So no process ever edits the
table: each study owns one small object, `<storage>/_index/<study>.json`, which it alone
rewrites (atomically: rename on a local disk, a single PUT on an object store). The table is
compiled from every index object on each read and, by a running study, at most every
`observe.COMPILE_MIN_INTERVAL_S` (a compile reads every study's object, so its cost grows with
the studies in the root; a study's own object is written at each change of its trial table). A
compiler re-lists the index after writing the table and compiles again if it changed meanwhile,
so the last table written holds every study whose index object was written before it (see
`compile_table`).
"""

from __future__ import annotations

import shlex
import time

import pyarrow as pa
from fsspec.implementations.local import LocalFileSystem

from service.core import ranking, storage, tables
from service.core.trial_status import TrialStatus
from service.study.layout import RootLayout, StudyLayout

COLUMNS = (
    "study",
    "description",
    "state",
    "study_file",
    "trials",
    "trials_finished",
    "trials_diverged",
    "trials_failed",
    "trials_stopped",
    "metric",
    "best_metric",
    "best_trial",
    "best_step",
    "best_checkpoint",
    "reproduce",
    "git_commit",
    "git_dirty",
    "uncommitted_diff",
    "updated_at",
)
MAX_RECOMPILES = 5


def index_uri(storage_root: str, study_name: str) -> str:
    return RootLayout(storage_root).index_entry(study_name)


def study_row(
    name: str,
    study_uri: str,
    description: str,
    metric: str,
    mode: str,
    trial_rows: list[dict],
    provenance: dict | None,
    state: str,
) -> dict:
    """The study's row, from its trial rows and its provenance record."""
    statuses = [r.get("status") for r in trial_rows]
    best = ranking.best_result(trial_rows, mode) or {}
    prov = provenance or {}
    return {
        "study": name,
        "description": description,
        "state": state,
        "study_file": StudyLayout(study_uri).study_file,
        "trials": len(trial_rows),
        "trials_finished": statuses.count(TrialStatus.FINISHED),
        "trials_diverged": statuses.count(TrialStatus.DIVERGED),
        "trials_failed": statuses.count(TrialStatus.FAILED),
        "trials_stopped": statuses.count(TrialStatus.STOPPED),
        "metric": metric,
        "best_metric": best.get("best_metric"),
        "best_trial": best.get("trial_name"),
        "best_step": best.get("best_step"),
        "best_checkpoint": best.get("best_checkpoint"),
        "reproduce": shlex.join(prov["reproduce"]) if prov.get("reproduce") else None,
        "git_commit": prov.get("git_commit"),
        "git_dirty": prov.get("git_dirty"),
        "uncommitted_diff": prov.get("uncommitted_diff"),
        "updated_at": time.time(),
    }


def write_row(storage_root: str, row: dict) -> None:
    """Write this study's index object (one PUT), leaving the root's table as it is."""
    storage.write_json(index_uri(storage_root, row["study"]), row)


def record(storage_root: str, row: dict) -> list[dict]:
    """Write this study's index object, then recompile the root's table. Returns its rows."""
    write_row(storage_root, row)
    return compile_table(storage_root)


def record_study(study, trial_rows: list[dict], state: str, provenance: dict | None) -> None:
    """The coordinator's call: this study's row, from its trial rows and provenance record, to
    its index object (the root's table is compiled apart from this, see the top)."""
    row = study_row(
        study.name,
        study.study_uri,
        study.description,
        study.training.metric,
        study.training.mode,
        trial_rows,
        provenance,
        state,
    )
    write_row(study.storage, row)


def read_index(storage_root: str) -> list[dict]:
    """Every study's row, straight from the index objects (sorted by study name)."""
    index_dir = RootLayout(storage_root).index_dir
    fs, path = storage.split(index_dir)
    fs.invalidate_cache(path)  # object-store listings are cached by fsspec; we need a fresh one
    if not fs.exists(path):
        return []
    paths = [p for p in fs.ls(path, detail=False) if p.endswith(".json")]
    found = _cat_all(fs, paths)
    rows = [storage.parse_json(b, storage.join(index_dir, p.rsplit("/", 1)[-1])) for p, b in found.items()]
    return sorted(rows, key=lambda r: r["study"])


def _cat_all(fs, paths: list[str]) -> dict[str, bytes]:
    """Each file's bytes in one whole-object GET (`open` + read would take the size from one
    generation of an object and the bytes from the next when another process replaces it
    between); a file deleted since the listing is left out. On an object store the GETs are
    concurrent (fsspec's batched `cat`), unless a path has glob characters, which `cat` would
    expand."""
    if paths and not isinstance(fs, LocalFileSystem) and not any(set("*?[") & set(p) for p in paths):
        return fs.cat(paths, on_error="omit")
    out = {}
    for p in paths:
        try:
            out[p] = fs.cat_file(p)
        except FileNotFoundError:
            continue
    return out


def compile_table(storage_root: str) -> list[dict]:
    """(Re)write `studies.parquet` and `studies.csv` from the index objects.

    Why the re-list makes the table complete: take the last table written, by process P. After
    writing it, P listed the index again and found what it had compiled (else it would have
    written again). Any study whose index object was written before that listing is in it;
    one written after would have compiled and written a table after P's -- not the last."""
    rows = read_index(storage_root)
    for _ in range(MAX_RECOMPILES):
        if not rows:
            return rows
        _write_table(storage_root, rows)
        again = read_index(storage_root)
        if again == rows:
            return rows
        rows = again
    _write_table(storage_root, rows)
    return rows


def _write_table(storage_root: str, rows: list[dict]) -> None:
    table = pa.table(tables.columns(rows, COLUMNS))
    root = RootLayout(storage_root)
    tables.write_parquet_csv(table, root.studies_parquet, root.studies_csv)


def read_table(storage_root: str) -> list[dict]:
    """The root's studies, compiled fresh from the index (and the table files rewritten)."""
    return compile_table(storage_root)
