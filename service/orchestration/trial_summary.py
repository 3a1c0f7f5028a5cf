"""A trial's summary (its last Tune report, a row of the trial table) from what it left in
storage: the rank-0 metrics log and the checkpoints kept; and the checkpoint folders a trial's
end removes (those Ray never registered, those a full disk cut off)."""

from __future__ import annotations

from service.analysis.input_bound import trial_input_row
from service.core import storage
from service.core.errors import CheckpointError, DataError, SpecError, StorageError, StorageFull
from service.core.ranking import best_row, first_best_step, worst
from service.core.trial_status import TrialStatus
from service.distributed import checkpoint
from service.planning.trial import TrialPlan
from service.study.layout import CHECKPOINT_PREFIX
from service.study.spec import Study
from service.trainer import metrics_log


def kept_summary(plan: TrialPlan, kept: list[tuple[str, dict]]) -> dict:
    """The summary of a trial that kept its checkpoints itself (`CheckpointStore`: URI, meta)."""
    return summary_fields(plan, {m["step"]: uri for uri, m in kept}, len(kept))


def failed_summary(plan: TrialPlan, error: DataError | SpecError | StorageFull) -> dict:
    """A final error (`final_error_of`) ends the trial without a retry (Tune restarts a trial
    that raises): the summary of a failed trial, with the error's message, also kept as the
    trial's error.txt where storage takes it (a full disk may not)."""
    message = str(error)
    if isinstance(error, StorageFull):
        remove_uncommitted_checkpoints(plan)
    try:
        storage.write_bytes_atomic(plan.layout.error_file, (message + "\n").encode())
    except StorageError:
        if not isinstance(error, StorageFull):
            raise
    return {
        plan.study.training.metric: worst(plan.study.training.mode),
        "status": TrialStatus.FAILED.reported,
        "error": message,
        "stops_study": isinstance(error, StorageFull),
        "best_step": None,
        "best_checkpoint": None,
    }


def summarize(plan: TrialPlan, result) -> dict:
    """The summary of a Ray Train run, from its retained checkpoints."""
    # Only committed checkpoints can be the trial's best (a torn one on storage never is).
    uris = [(m.get("step"), _uri(plan.study, c.path)) for c, m in result.best_checkpoints]
    by_step = {step: uri for step, uri in uris if is_committed(uri)}
    return summary_fields(plan, by_step, len(result.best_checkpoints))


def summary_fields(plan: TrialPlan, checkpoint_by_step: dict[int, str], num_checkpoints: int) -> dict:
    """Trial summary from the rank-0 metrics log (Ray keeps only checkpointed reports) and the
    retained checkpoints (the best one, chosen retrospectively over the whole run). Its
    `last_metric` is the last evaluation's: a trial resumed at its last checkpoint reports no
    evaluation in this attempt, and its row's `metric` comes from here."""
    tr = plan.study.training
    history = metrics_log.read(plan.metrics_uri)
    best = best_row(history, tr.metric, tr.mode)
    last = history[-1] if history else {}
    return {
        tr.metric: best[tr.metric] if best else worst(tr.mode),
        "status": last.get("status", TrialStatus.FINISHED.reported),
        "last_step": last.get("step", 0),
        "last_metric": last.get(tr.metric),
        "best_step": best["step"] if best else None,
        "reached_best_step": first_best_step(history, tr.metric, tr.mode),  # where a plateau began
        "best_checkpoint": checkpoint_by_step.get(best["step"]) if best else None,
        "num_checkpoints": num_checkpoints,
        "diverged_at_step": last.get("diverged_at_step"),
        **trial_input_row(plan.trial_name, history, plan.study),
    }


def prune_unregistered(plan: TrialPlan, result) -> list[str]:
    """Remove the trial's checkpoint directories that Ray never registered: those a worker
    persisted after its driver or controller died (Ray's snapshot does not know them, so its
    retention never deletes them). Returns the removed paths."""
    kept = {c.path.rstrip("/") for c, _ in result.best_checkpoints}
    if result.checkpoint is not None:  # the latest, kept besides the N best (for resuming)
        kept.add(result.checkpoint.path.rstrip("/"))
    kept = {k.lstrip("/") for k in kept}
    return _remove_checkpoint_folders(plan, lambda path, _name: path.lstrip("/") not in kept)


def remove_uncommitted_checkpoints(plan: TrialPlan) -> list[str]:
    """Remove the trial's checkpoint folders that are not whole: what a copy to storage cut off
    by a full disk left (never selectable, and holding the bytes the study's own records need;
    Ray Train copies the manifest first, so it may be there).
    Only once the trial is over: no copy is under way. Returns the removed paths."""
    return _remove_checkpoint_folders(
        plan, lambda _path, name: not is_committed(storage.join(plan.trial_uri, name))
    )


def _remove_checkpoint_folders(plan: TrialPlan, chosen) -> list[str]:
    """Remove the trial's checkpoint folders for which `chosen(path, name)` is true (`path` as
    the trial's file system lists it); the removed paths."""
    fs, trial_path = storage.split(plan.trial_uri)
    try:
        entries = fs.ls(trial_path, detail=True)
    except FileNotFoundError:
        return []
    removed = []
    for e in entries:
        path = e["name"].rstrip("/")
        name = path.rsplit("/", 1)[-1]
        if e["type"] == "directory" and name.startswith(CHECKPOINT_PREFIX) and chosen(path, name):
            fs.rm(path, recursive=True)
            removed.append(path)
    return removed


def is_committed(checkpoint_uri: str) -> bool:
    """Whether the checkpoint at a storage URI is whole (its manifest matches its files)."""
    try:
        checkpoint.verify(checkpoint_uri, lambda name: storage.read_bytes(storage.join(checkpoint_uri, name)))
    except CheckpointError:
        return False
    return True


def _uri(study: Study, path: str) -> str:
    """A checkpoint's path inside Ray's storage filesystem -> a URI users can open."""
    if "://" in study.storage:
        return study.storage.split("://", 1)[0] + "://" + path.lstrip("/")
    return path
