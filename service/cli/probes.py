"""Sweeps that pick one setting of a study: `playbook find-steps` (max_train_steps, from a sweep of
constant learning rates) and `playbook find-batch-size` (the per-worker batch size)."""

from __future__ import annotations

import dataclasses
import sys

from service.cli.prepare import check_cluster, connect_ray, load_study
from service.core.errors import SpecError


def cmd_find_steps(args) -> int:
    from service import workloads
    from service.core import storage
    from service.orchestration.study_run import run_study
    from service.planning import find_steps
    from service.study.checks import check_data, check_storage
    from service.study.stored import check_same_study

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
    connect_ray(workloads.import_path(args.study_file))
    check_cluster(sweep)
    rows = run_study(sweep)
    found = find_steps.choose(
        fit_steps(sweep, rows, study.find_steps.train_loss_threshold),
        study.find_steps.max_train_steps,
        study.find_steps.train_loss_threshold,
    )
    for lr, step in found.fit_steps:
        print(f"learning_rate={lr:g}: " + (f"fits at step {step}" if step else "does not fit"))
    storage.write_json(sweep.layout.find_steps, dataclasses.asdict(found))
    print(found.message, file=sys.stdout if found.ok else sys.stderr)
    return 0 if found.ok else 1


def fit_steps(sweep, rows: list[dict], threshold: float) -> dict:
    """Each swept learning rate's first step whose train loss is under the threshold (or None)."""
    from service.planning import find_steps
    from service.planning.trial import TrialPlan
    from service.trainer import metrics_log

    fits = {}
    for row in rows:
        plan = TrialPlan(sweep, row["trial_name"], row["round"])
        fits[row["hp/learning_rate"]] = find_steps.first_fit_step(
            metrics_log.read(plan.metrics_uri), threshold
        )
    return fits


def cmd_find_batch_size(args) -> int:
    from service import workloads
    from service.analysis.batch_size import check_options, probe_sizes
    from service.orchestration.batch_probe_task import find_batch_size
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
