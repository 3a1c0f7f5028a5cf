"""`playbook`: run | validate | status | report | studies | eval | find-steps | find-batch-size |
data | demo."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from service.core import ranking
from service.core.errors import PlaybookError, SpecError, StudyNotFound
from service.core.formatting import cell
from service.core.trial_status import TrialStatus
from service.data.make import DATASETS
from service.study import spec
from service.study.layout import INDEX_DIR, RootLayout, StudyLayout

DEMO_STUDY = "studies/digits-demo.yaml"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        code = args.func(args) or 0
        sys.stdout.flush()  # a reader gone away is found here, not in the interpreter's exit
        return code
    except BrokenPipeError:
        return output_closed()
    except PlaybookError as e:
        print(f"playbook: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("playbook: interrupted", file=sys.stderr)
        return 130


def output_closed() -> int:
    """The reader of stdout went away (`playbook status ... | head`): exit 1 without a traceback,
    the Python docs' way: stdout onto /dev/null, so that the interpreter's own flush of what is
    still buffered fails no more at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 1


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="playbook", description=__doc__)
    sub = p.add_subparsers(required=True, metavar="COMMAND")

    c = sub.add_parser("run", help="run a study on the Ray cluster in RAY_ADDRESS (or a local one)")
    c.add_argument("study_file")
    c.add_argument("--storage", help="override the study file's storage URI")
    c.set_defaults(func=cmd_run)

    c = sub.add_parser("validate", help="check a study file; exit 2 with the bad field if wrong")
    c.add_argument("study_file")
    c.add_argument("--data", action="store_true", help="also check the data files")
    c.set_defaults(func=cmd_validate)

    c = sub.add_parser("status", help="trial table of a running or finished study")
    c.add_argument(
        "study", help="a study file, a study URI (the folder holding its study.yaml), or a study name"
    )
    c.add_argument(
        "--storage", help="storage root of a study name (default: $PLAYBOOK_STORAGE or ./playbook-studies)"
    )
    c.set_defaults(func=cmd_status)

    c = sub.add_parser("report", help="write a study's HTML report and print it as a table")
    c.add_argument("study", help="a study file, or a study URI (the folder holding its study.yaml)")
    c.add_argument("--out", help="where to write the HTML (default: <study>/report.html)")
    c.set_defaults(func=cmd_report)

    c = sub.add_parser("studies", help="the storage root's tracking table: one row per study")
    c.add_argument("--storage", help="storage root URI (default: $PLAYBOOK_STORAGE or ./playbook-studies)")
    c.set_defaults(func=cmd_studies)

    c = sub.add_parser("eval", help="evaluate a saved checkpoint on a whole split, on the cluster")
    c.add_argument("checkpoint_uri")
    c.add_argument("--split", default="test", choices=["train", "validation", "test"])
    c.set_defaults(func=cmd_eval)

    c = sub.add_parser("find-steps", help="sweep constant learning rates to pick max_train_steps")
    c.add_argument("study_file")
    c.add_argument("--storage", help="override the study file's storage URI")
    c.set_defaults(func=cmd_find_steps)

    c = sub.add_parser("find-batch-size", help="probe per-worker batch sizes for the largest that pays")
    c.add_argument("study_file")
    c.add_argument("--min", type=int, default=8, help="smallest per-worker size, a power of 2 (default 8)")
    c.add_argument("--max", type=int, default=1024, help="largest per-worker size, power of 2 (default 1024)")
    c.add_argument("--steps", type=int, default=20, help="steps timed per block (default 20)")
    c.add_argument("--min-gain", type=float, help="fraction of examples/s a doubling must add (0.1)")
    c.add_argument("--out", help="the table's JSON (default: <study>/batch_size.json; .txt beside it)")
    c.set_defaults(func=cmd_find_batch_size)

    c = sub.add_parser("data", help="write a built-in dataset as parquet shards")
    c.add_argument("dataset", choices=sorted(DATASETS))
    c.add_argument("uri")
    c.add_argument("--count", type=int, help="number of examples (default: the data set's own)")
    c.add_argument("--seed", type=int, default=0, help="seed of everything drawn")
    c.add_argument("--max-bytes", type=int, help="text only: the corpus's size (default: all of it)")
    c.add_argument("--seq-len", type=int, help="text only: bytes per sequence (default 256)")
    c.set_defaults(func=cmd_data)

    c = sub.add_parser("preprocess", help="preprocess raw parquet offline into shards for a workload")
    c.add_argument("source", help="raw parquet files (a directory, glob or file; any fsspec URI)")
    c.add_argument("dest", help="where the shards and _provenance.json go")
    c.add_argument("--workload", required=True, help="built-in name or package.module:Class")
    c.add_argument("--num-files", type=int, default=8, help="shards (a multiple of the host count)")
    c.add_argument("--row-group-size", type=int, default=1024, help="rows per row group")
    c.add_argument("--seed", type=int, default=0, help="seed of the rows-to-shards assignment")
    c.set_defaults(func=cmd_preprocess)

    c = sub.add_parser("demo", help="write the digits data and run the demo study locally")
    c.add_argument("--study-file", default=DEMO_STUDY)
    c.set_defaults(func=cmd_demo)
    return p


def load_study(path: str, storage_override: str | None = None) -> spec.Study:
    from service import workloads
    from service.study.checks import check_workload, resolve_paths

    workloads.use_import_path(workloads.import_path(path))  # a workload module of one's own
    study = resolve_paths(spec.load_file(path), storage_override)
    check_workload(study)
    return study


def cmd_validate(args) -> int:
    study = load_study(args.study_file)
    if args.data:
        from service.study.checks import check_data

        check_data(study)
    from service.analysis.round_checks import validate_findings

    for level, field, message in validate_findings(study):  # on stderr: stdout ends with ok
        print(f"{level}: {field}: {message}", file=sys.stderr)
    trials = sum(r.num_trials for r in study.rounds)
    print(
        f"ok: study {study.name}: {len(study.rounds)} round(s), {trials} trials, "
        f"{study.scaling.world_size} worker(s) per trial"
    )
    return 0


def connect_ray(import_path: list[str] | None = None) -> None:
    """Connect to RAY_ADDRESS or start an embedded Ray; every process of the job imports from
    `import_path` first (a workload module of one's own, see `workloads.ray_env`)."""
    import ray

    from service import workloads
    from service.orchestration.coordinator import NAMESPACE

    if not ray.is_initialized():
        ray.init(
            # No RAY_ADDRESS: an embedded Ray of our own ("local"), never a cluster that some
            # other process happens to run on this machine (what address=None would join).
            address=os.environ.get("RAY_ADDRESS") or "local",
            namespace=NAMESPACE,
            runtime_env={"env_vars": {"PYTHONUNBUFFERED": "1", **workloads.ray_env(import_path or [])}},
        )


def check_cluster(study: spec.Study) -> None:
    """The connected Ray cluster can hold one trial of the study (refused before it starts)."""
    import ray

    from service.orchestration.ray_private import cluster_config
    from service.study.checks import autoscaler_nodes, check_resources

    # An autoscaling cluster is judged by what it can grow to, a fixed one by what it has.
    check_resources(study, autoscaler_nodes(cluster_config(), study) or ray.nodes())


def cmd_run(args) -> int:
    from service import workloads
    from service.orchestration.coordinator import run_study
    from service.study.checks import check_data, check_same_study, check_storage
    from service.tracking import provenance

    study = load_study(args.study_file, args.storage)
    check_data(study)
    check_storage(study)
    check_same_study(study)
    from service.tracking.mlflow_mirror import check_available

    check_available(study)
    paths = workloads.import_path(args.study_file)
    connect_ray(paths)
    check_cluster(study)  # before anything is written
    record = provenance.capture(study.study_uri, study.workload, paths)
    from service.data.preprocess import record_in_study

    for line in record_in_study(study):
        print(line)
    print(provenance.summary(record))
    rows = run_study(study)
    print_table(rows, study.training.metric, study.training.mode)
    print_verdicts(study.study_uri)
    failed = [r["trial_name"] for r in rows if r.get("status") == TrialStatus.FAILED]
    if failed:
        print(f"playbook: {len(failed)} trial(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def cmd_status(args) -> int:
    from service.core import storage
    from service.tracking import trial_table

    if os.path.isfile(args.study):
        study = load_study(args.study, args.storage)
        name, study_uri = study.name, study.study_uri
        metric, mode = study.training.metric, study.training.mode
    else:
        # A study folder (holding its study.yaml, as `playbook report` takes) when the argument
        # is a path, else a study name under --storage (default $PLAYBOOK_STORAGE or
        # ./playbook-studies); a study name has no '/'.
        study_uri = storage.absolute(args.study).rstrip("/")
        if "/" in args.study or (not args.storage and os.path.isdir(args.study)):
            if args.storage:
                raise SpecError(f"study: {args.study} is a path; --storage goes with a study name")
            if not storage.exists(StudyLayout(study_uri).study_file):
                raise StudyNotFound(f"{args.study}: no study.yaml there (not a study folder)")
        else:
            root = storage.absolute(args.storage or os.environ.get("PLAYBOOK_STORAGE", "./playbook-studies"))
            study_uri = StudyLayout.of(root, args.study).uri
        name, metric, mode = study_uri.rstrip("/").rsplit("/", 1)[-1], "validation/error", "min"
        stored_file = StudyLayout(study_uri).study_file
        if storage.exists(stored_file):
            stored = spec.load_text(storage.read_bytes(stored_file).decode(), source=stored_file)
            name, metric, mode = stored.name, stored.training.metric, stored.training.mode
    live = None
    if os.environ.get("RAY_ADDRESS"):
        from service.orchestration.coordinator import live_status

        connect_ray()
        live = live_status(name)
    if live:
        print(f"study {name}: {live['state']} (round {live['round']})")
        rows = live["trials"]
    else:
        rows = trial_table.read_rows(study_uri)
        if not rows:
            raise StudyNotFound(f"{name}: no running coordinator and no trials under {study_uri}")
        print(f"study {name}: stored at {study_uri}")
    print_table(rows, metric, mode)
    print_verdicts(study_uri)
    return 0


def print_verdicts(study_uri: str) -> None:
    from service.analysis.report_lines import log_lines
    from service.core import storage

    uri = StudyLayout(study_uri).verdicts
    if storage.exists(uri):
        for summary in json.loads(storage.read_bytes(uri)):
            for line in log_lines(summary):
                print(line)


def cmd_report(args) -> int:
    from service import report

    data = report.load(report.study_uri_of(args.study))
    out, sentences = report.write(data, args.out)
    print(f"study {data.study.name}: {data.study_uri}")
    print_table(data.rows, data.metric, data.mode)
    for s in sentences:
        print(f"{s.section}: {'WARNING ' if s.severity == 'warning' else ''}{s.kind}: {s.text}")
    print(f"report: {out}")
    return 0


def cmd_studies(args) -> int:
    from service.core import storage
    from service.tracking import study_index

    root = storage.absolute(args.storage or os.environ.get("PLAYBOOK_STORAGE", "./playbook-studies"))
    rows = study_index.read_table(root)
    if not rows:
        raise StudyNotFound(f"{root}: no studies recorded there (no {INDEX_DIR}/)")
    cols = ["study", "state", "trials", "trials_finished", "trials_diverged", "trials_failed"]
    cols += ["best_metric", "best_trial", "git_commit"]
    lines = [[cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(line[i]) for line in lines)) for i, c in enumerate(cols)]
    for line in [cols, *lines]:
        print("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)))
    print(f"table: {RootLayout(root).studies_parquet} (.csv)")
    return 0


def cmd_find_steps(args) -> int:
    from service.core import storage
    from service.orchestration.coordinator import run_study
    from service.orchestration.launch import read_metrics_log
    from service.planning import find_steps
    from service.planning.trial import TrialPlan
    from service.study.checks import check_data, check_same_study, check_storage

    study = load_study(args.study_file, args.storage)
    if study.find_steps is None:
        raise SpecError(
            "find_steps: required by playbook find-steps (learning_rates, "
            "max_train_steps, train_loss_threshold)"
        )
    sweep = find_steps.sweep_study(study)
    check_data(sweep)
    check_storage(sweep)
    check_same_study(sweep)
    from service import workloads

    connect_ray(workloads.import_path(args.study_file))
    check_cluster(sweep)
    rows = run_study(sweep)
    threshold = study.find_steps.train_loss_threshold
    fits = {}
    for row in rows:
        plan = TrialPlan(sweep, row["trial_name"], row["round"])
        fits[row["hp/learning_rate"]] = find_steps.first_fit_step(read_metrics_log(plan), threshold)
    found = find_steps.choose(fits, study.find_steps.max_train_steps, threshold)
    for lr, step in found.fit_steps:
        print(f"learning_rate={lr:g}: " + (f"fits at step {step}" if step else "does not fit"))
    storage.write_json(sweep.layout.find_steps, dataclasses.asdict(found))
    print(found.message, file=sys.stdout if found.ok else sys.stderr)
    return 0 if found.ok else 1


def cmd_find_batch_size(args) -> int:
    from service import workloads
    from service.analysis.batch_size import probe_sizes
    from service.orchestration.batch_probe_task import check_options, find_batch_size
    from service.study.checks import check_data, check_storage
    from service.trainer.batch_probe import probe_study

    study = load_study(args.study_file)
    sizes = probe_sizes(args.min, args.max, study)
    min_gain = check_options(args.steps, args.min_gain)
    check_data(study)
    check_storage(study)
    connect_ray(workloads.import_path(args.study_file))
    check_cluster(probe_study(study, sizes[0]))  # one worker's resources
    find_batch_size(study, sizes, args.steps, args.out, min_gain)
    return 0


def cmd_eval(args) -> int:
    from service import workloads
    from service.core import storage
    from service.evaluation.offline import locate, metrics_uri, output_uri, split_uri, stored_study
    from service.orchestration.launch import run_offline_eval
    from service.tracking import provenance

    uri = storage.absolute(args.checkpoint_uri)
    from service.trainer import checkpoint

    if not storage.exists(storage.join(uri, checkpoint.STATE_FILE)):
        raise StudyNotFound(f"{args.checkpoint_uri}: no checkpoint there (no {checkpoint.STATE_FILE})")

    # A torn checkpoint (no manifest, or files that differ from it): one line, nothing started.
    checkpoint.verify(uri, lambda name: storage.read_bytes(storage.join(uri, name)))
    study = stored_study(locate(uri)[0])
    split_uri(study, args.split)  # the split exists
    # The workload is imported as `playbook run` imported it (and from here).
    paths = [*(provenance.read(locate(uri)[0]) or {}).get("import_path", []), os.path.abspath(os.getcwd())]
    workloads.use_import_path(paths)
    connect_ray(paths)
    run_offline_eval(uri, args.split, study)
    out = output_uri(uri, args.split)
    metrics = json.loads(storage.read_bytes(metrics_uri(uri, args.split)))
    per_class = metrics.pop("per_class", None)
    for k in sorted(metrics):
        print(f"{args.split}/{k}: {cell(metrics[k])}")
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
    print(f"metrics and predictions: {out}")
    return 0


def cmd_data(args) -> int:
    from service.core import storage
    from service.core.errors import DataError

    text_only = {"max_bytes": args.max_bytes, "seq_len": args.seq_len}
    options = {k: v for k, v in text_only.items() if v is not None}
    if options and args.dataset != "text":
        raise DataError(f"--{next(iter(options)).replace('_', '-')}: only `playbook data text` takes it")
    written = DATASETS[args.dataset](storage.absolute(args.uri), args.count, args.seed, **options)
    for split, files in written.items():
        print(f"{split}: {len(files)} files under {storage.join(storage.absolute(args.uri), split)}")
    return 0


def cmd_preprocess(args) -> int:
    from service import workloads
    from service.core import storage
    from service.data.preprocess import PROVENANCE_FILE, preprocess

    workloads.use_import_path([os.path.abspath(os.getcwd())])

    dest = storage.absolute(args.dest)
    record = preprocess(
        workloads.get(args.workload),
        storage.absolute(args.source),
        dest,
        num_files=args.num_files,
        row_group_size=args.row_group_size,
        seed=args.seed,
    )
    print(
        f"preprocessed {sum(f['num_rows'] for f in record['source_files'])} rows of "
        f"{len(record['source_files'])} files into {len(record['files'])} shards under {dest} "
        f"({record['num_rows']} rows; provenance: {storage.join(dest, PROVENANCE_FILE)})"
    )
    return 0


def cmd_demo(args) -> int:
    from service.core import storage
    from service.data.builtin import write_digits

    raw = spec.load_file(args.study_file)
    data_root = os.path.dirname(storage.absolute(raw.data.train).rstrip("/"))
    if not storage.exists(raw.data.train):
        print(f"writing the digits dataset to {data_root}")
        write_digits(data_root)
    return cmd_run(argparse.Namespace(study_file=args.study_file, storage=None))


def print_table(rows: list[dict], metric: str, mode: str) -> None:
    hp_cols = sorted({k for r in rows for k in r if k.startswith("hp/")})
    cols = ["trial_name", "status", "step", "seed", *hp_cols, "best_metric", "best_step"]
    header = [c.removeprefix("hp/") for c in cols]
    header[cols.index("best_metric")] = f"best {metric}"
    lines = [[cell(r.get(c)) for c in cols] for r in sorted(rows, key=lambda r: r["trial_name"])]
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


if __name__ == "__main__":
    sys.exit(main())
