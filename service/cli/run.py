"""Running a study: `playbook run`, `validate` (the study file, before a run) and `demo`."""

from __future__ import annotations

import argparse
import os
import sys

from service.cli.prepare import check_cluster, connect_ray, load_study
from service.cli.results import print_table
from service.core.trial_status import DONE, TrialStatus
from service.study import spec

DEMO_STUDY = "studies/digits-demo.yaml"


def cmd_validate(args) -> int:
    from service.planning.plan_size import check_budget

    study = load_study(args.study_file)
    check_budget(study)
    if args.data:
        from service.study.checks import check_data

        check_data(study)
    from service.analysis.round_checks import validate_findings

    for level, field, message in validate_findings(study):  # on stderr: stdout ends with ok
        print(f"{level}: {field}: {message}", file=sys.stderr)
    print(f"ok: {plan_text(study)}")
    return 0


def plan_text(study: spec.Study) -> str:
    from service.planning.plan_size import planned_steps, planned_trials

    return (
        f"study {study.name}: {len(study.rounds)} round(s), {planned_trials(study)} trials, "
        f"{planned_steps(study)} training steps, {study.scaling.world_size} worker(s) per trial"
    )


def cmd_run(args) -> int:
    from service import workloads
    from service.orchestration.study_run import run_study
    from service.planning.plan_size import check_budget
    from service.study.checks import check_data, check_storage
    from service.study.stored import check_same_study
    from service.tracking import provenance

    study = load_study(args.study_file, args.storage)
    check_budget(study)
    check_data(study)
    check_storage(study)
    check_same_study(study)
    from service.tracking.mlflow_mirror import check_available

    check_available(study)
    paths = workloads.import_path(args.study_file)
    dashboard = connect_ray(paths, verbose=args.verbose)
    check_cluster(study)  # before anything is written
    if args.dry_run:
        return dry_run(study)
    if dashboard:
        print(f"ray: a local Ray for this run, its dashboard at http://{dashboard}")
    record = provenance.capture(study.study_uri, study.workload, paths)
    from service.data.preprocess import record_in_study

    for line in record_in_study(study):
        print(line)
    print(provenance.summary(record))
    from service.cli.live_table import view_for

    # its lines as it goes (a live table below them on a terminal); each round's verdicts once;
    # on a cluster that outlives the run, the study's last metric values reach Prometheus
    on_cluster = bool(os.environ.get("RAY_ADDRESS"))
    rows = run_study(study, view_for(study.training.metric), settle_metrics=on_cluster)
    print_table(rows, study.training.metric, study.training.mode)
    failed = [r["trial_name"] for r in rows if r.get("status") == TrialStatus.FAILED]
    if failed:
        print(f"playbook: {len(failed)} trial(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def dry_run(study: spec.Study) -> int:
    """`run --dry-run`, after every check `run` makes before it writes: what a run would do."""
    import ray

    from service.orchestration.coordinator import trials_that_fit
    from service.orchestration.study_run import check_not_running
    from service.planning.plan_size import planned_trials
    from service.tracking.trial_table import read_rows

    check_not_running(study)
    rows = read_rows(study.study_uri)  # a stopped study's, even with no trial done, is resumed
    done = sum(r.get("status") in DONE for r in rows)
    print(f"ok: {plan_text(study)}")
    print(
        f"dry run: storage {study.study_uri} takes writes; this cluster holds "
        f"{trials_that_fit(study, ray.cluster_resources())} of its trials at once; a run "
        + (f"resumes it ({done} of {planned_trials(study)} trials done)" if rows else "starts it")
        + "; nothing was started"
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
    return cmd_run(
        argparse.Namespace(study_file=args.study_file, storage=None, verbose=args.verbose, dry_run=False)
    )
