"""What a study left behind: `playbook status` (its trial table, live or stored), `report` (the
HTML report), `studies` (the storage root's table of studies) and `eval` (a saved checkpoint on a
whole split); and the trial table and verdict lines that `run` prints too."""

from __future__ import annotations

import json
import os

from service.cli.prepare import check_eval_cluster, connect_ray, load_study
from service.core import ranking
from service.core.errors import SpecError, StudyNotFound
from service.core.formatting import cell
from service.study import spec
from service.study.layout import INDEX_DIR, RootLayout, StudyLayout


def cmd_status(args) -> int:
    from service.core import storage

    if os.path.isfile(args.study):
        study = load_study(args.study, args.storage)
        name, study_uri = study.name, study.study_uri
        metric, mode = study.training.metric, study.training.mode
    else:
        study_uri = stored_study_uri(args.study, args.storage)
        name, metric, mode = stored_naming(study_uri)
    verdicts = storage.read_json(StudyLayout(study_uri).verdicts, [])  # read before anything is printed
    rows = status_rows(name, study_uri)
    print_table(rows, metric, mode)
    print_chain(study_uri)
    print_verdicts(verdicts)
    return 0


def storage_root(storage_arg: str | None) -> str:
    """--storage, else $PLAYBOOK_STORAGE, else ./playbook-studies."""
    from service.core import storage

    return storage.absolute(storage_arg or os.environ.get("PLAYBOOK_STORAGE", "./playbook-studies"))


def stored_study_uri(study: str, storage_arg: str | None) -> str:
    """A study folder (holding its study.yaml, as `playbook report` takes) when the argument is a
    path, else a study name under --storage (default $PLAYBOOK_STORAGE or ./playbook-studies); a
    study name has no '/'."""
    from service.core import storage

    study_uri = storage.absolute(study).rstrip("/")
    if "/" in study or (not storage_arg and os.path.isdir(study)):
        if storage_arg:
            raise SpecError(f"study: {study} is a path; --storage goes with a study name")
        if not storage.exists(StudyLayout(study_uri).study_file):
            raise StudyNotFound(f"{study}: no study.yaml there (not a study folder)")
        return study_uri
    return StudyLayout.of(storage_root(storage_arg), study).uri


def stored_naming(study_uri: str) -> tuple[str, str, str]:
    """(name, metric, mode) of a stored study: its study.yaml's, else the folder's name with the
    default metric."""
    from service.core import storage

    stored_file = StudyLayout(study_uri).study_file
    if storage.exists(stored_file):
        stored = spec.load_text(storage.read_bytes(stored_file).decode(), source=stored_file)
        return stored.name, stored.training.metric, stored.training.mode
    return study_uri.rstrip("/").rsplit("/", 1)[-1], "validation/error", "min"


def status_rows(name: str, study_uri: str) -> list[dict]:
    """The running coordinator's trials when RAY_ADDRESS is set and one runs the study, else the
    stored trial table; its first line says which."""
    from service.tracking import trial_table

    live = None
    if os.environ.get("RAY_ADDRESS"):
        from service.orchestration.study_run import live_status

        connect_ray()
        live = live_status(name)
    if live:
        print(f"study {name}: {live['state']} (round {live['round']})")
        return live["trials"]
    rows = trial_table.read_rows(study_uri)
    if not rows:
        raise StudyNotFound(f"{name}: no running coordinator and no trials under {study_uri}")
    print(f"study {name}: {recorded_state(study_uri)}; stored at {study_uri}")
    return rows


def recorded_state(study_uri: str) -> str:
    """The state the study's coordinator last recorded in its storage root's index: finished,
    stopped, or running (which no coordinator answered for here)."""
    from service.core import storage

    state = storage.read_json(StudyLayout(study_uri).index_entry, {}).get("state")
    if state == "running":
        return "running when last recorded (no coordinator of it answered here)"
    return state or "no state recorded"


def cmd_report(args) -> int:
    from service import report
    from service.study.chain import chain

    data = report.load(report.study_uri_of(args.study))
    out, sentences = report.write(data, args.out)
    print(f"study {data.study.name}: {data.study_uri}")
    print_table(data.rows, data.metric, data.mode)
    print("rounds:")
    for link in chain(data.study):
        print(f"  {link.line()}")
    for s in sentences:
        print(f"{s.section}: {'WARNING ' if s.severity == 'warning' else ''}{s.kind}: {s.text}")
    print(f"report: {out}")
    return 0


def cmd_studies(args) -> int:
    from service.tracking import study_index

    root = storage_root(args.storage)
    rows = study_index.read_table(root)
    if not rows:
        raise StudyNotFound(f"{root}: no studies recorded there (no {INDEX_DIR}/)")
    cols = ["study", "state", "trials", "trials_finished", "trials_diverged", "trials_failed"]
    cols += ["trials_stopped", "best_metric", "best_trial", "git_commit"]
    lines = [[cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(line[i]) for line in lines)) for i, c in enumerate(cols)]
    for line in [cols, *lines]:
        print("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)))
    print(f"table: {RootLayout(root).studies_parquet} (.csv)")
    return 0


def cmd_eval(args) -> int:
    from service import workloads
    from service.core import storage
    from service.evaluation.offline import locate, metrics_uri, output_uri, split_uri, stored_study
    from service.orchestration.offline_eval import run_offline_eval
    from service.tracking import provenance

    uri = checked_checkpoint(args.checkpoint_uri)
    study = stored_study(locate(uri)[0])
    split_uri(study, args.split)  # the split exists
    if args.num_workers is not None and args.num_workers < 1:
        raise SpecError(f"--num-workers: must be >= 1 (got {args.num_workers})")
    # The workload is imported as `playbook run` imported it (and from here).
    paths = [*(provenance.read(locate(uri)[0]) or {}).get("import_path", []), os.path.abspath(os.getcwd())]
    workloads.use_import_path(paths)
    connect_ray(paths)
    check_eval_cluster(study, args.num_workers)
    run_offline_eval(uri, args.split, study, args.num_workers)
    print_eval_metrics(json.loads(storage.read_bytes(metrics_uri(uri, args.split))), args.split)
    print(f"metrics and predictions: {output_uri(uri, args.split)}")
    return 0


def cmd_export(args) -> int:
    """The checkpoint's model as one file (consolidated from its shards when it is sharded)."""
    from service import workloads
    from service.core import storage
    from service.distributed import export, sharded
    from service.evaluation.offline import locate, restored_model, stored_study
    from service.tracking import provenance

    uri = checked_checkpoint(args.checkpoint_uri)
    study_uri = locate(uri)[0]
    study = stored_study(study_uri)
    workloads.use_import_path([*(provenance.read(study_uri) or {}).get("import_path", []), os.getcwd()])
    state = sharded.load_state(uri)
    model = restored_model(study, workloads.get(study.workload), state, "cpu")
    metadata = {"checkpoint": uri, "step": str(state.step), "workload": study.workload}
    storage.write_bytes_atomic(
        storage.absolute(args.out), export.to_bytes(model.state_dict(), args.format, metadata)
    )
    print(f"{args.format} state dict of {study.workload} at step {state.step}: {args.out}")
    return 0


def checked_checkpoint(checkpoint_uri: str) -> str:
    """The checkpoint's absolute URI, refused in one line when it is missing or torn (no manifest,
    or files that differ from it): before anything starts."""
    from service.core import storage
    from service.distributed import checkpoint, sharded

    uri = storage.absolute(checkpoint_uri)
    if not storage.exists(storage.join(uri, checkpoint.STATE_FILE)):
        raise StudyNotFound(f"{checkpoint_uri}: no checkpoint there (no {checkpoint.STATE_FILE})")
    sharded.verify(uri)  # every file, read in chunks (a sharded checkpoint's shards may be large)
    return uri


def print_eval_metrics(metrics: dict, split: str) -> None:
    per_class = metrics.pop("per_class", None)
    for k in sorted(metrics):
        print(f"{split}/{k}: {cell(metrics[k])}")
    if per_class:
        print("class  support  precision [95% CI]        recall [95% CI]     one example moves recall by")
        for c in per_class:
            p_lo, p_hi = c["precision_interval"]
            r_lo, r_hi = c["recall_interval"]
            print(
                f"{c['class']:>5}  {c['support']:>7}  {cell(c['precision']):>6} "
                f"[{p_lo:.3f}, {p_hi:.3f}]  {cell(c['recall']):>6} [{r_lo:.3f}, {r_hi:.3f}]  "
                f"{cell(c['recall_per_example'])}"
            )


def print_chain(study_uri: str) -> None:
    """The stored study's rounds as a chain: what each changed from the one before, and why."""
    from service.core import storage
    from service.study.chain import chain
    from service.study.stored import load_stored

    if storage.exists(StudyLayout(study_uri).study_file):
        print("rounds:")
        for link in chain(load_stored(study_uri)):
            print(f"  {link.line()}")


def print_verdicts(summaries: list[dict]) -> None:
    from service.analysis.report_lines import log_lines

    for summary in summaries:
        for line in log_lines(summary):
            print(line)


def print_table(rows: list[dict], metric: str, mode: str) -> None:
    from service.tracking import trial_table

    hp_cols = sorted({k for r in rows for k in r if k.startswith("hp/")})
    cols = ["trial_name", "status", "step", "seed", *hp_cols, "best_metric", "best_step"]
    header = [c.removeprefix("hp/") for c in cols]
    header[cols.index("best_metric")] = f"best {metric}"
    lines = [[cell(r.get(c)) for c in cols] for r in trial_table.in_round_order(rows)]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    for line in lines:
        print("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)))
    best = ranking.best_result(rows, mode)
    if best:
        print(
            f"best trial: {best['trial_name']} {metric}={cell(best['best_metric'])} "
            f"at step {best.get('best_step')}"
        )
        print(f"best checkpoint: {best.get('best_checkpoint')}")
