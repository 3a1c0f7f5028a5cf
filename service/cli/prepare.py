"""What a command does before it runs anything: load the study file (with its own workload
module), connect to Ray, and check that the cluster can hold a trial."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys

from service.cli import reaper
from service.core import stop_signal
from service.study import spec


def load_study(path: str, storage_override: str | None = None) -> spec.Study:
    from service import workloads
    from service.study.checks import check_workload, resolve_paths
    from service.study.stored import link_rounds

    workloads.use_import_path(workloads.import_path(path))  # a workload module of one's own
    study = link_rounds(resolve_paths(spec.load_file(path), storage_override))
    check_workload(study)
    return study


def connect_ray(import_path: list[str] | None = None, verbose: bool = False) -> str | None:
    """Connect to RAY_ADDRESS or start an embedded Ray; every process of the job imports from
    `import_path` first (a workload module of one's own, see `workloads.ray_env`). Ray's own
    INFO records, Tune's output and Ray's lines of `ray_private.RAY_NOISE` only when `verbose`.
    Returns the dashboard URL of an embedded Ray (None when connected to a cluster, or already
    connected)."""
    import ray

    from service.orchestration.coordinator import NAMESPACE
    from service.orchestration.ray_private import drop_ray_noise, token_auth_without_warning
    from service.orchestration.worker_console import VERBOSE_ENV

    if ray.is_initialized():
        return None
    address = os.environ.get("RAY_ADDRESS")
    if not (sys.stdout.isatty() and sys.stderr.isatty()):
        # The "(Name pid=N)" prefix of the lines Ray forwards from its processes, uncoloured
        # where they land in a file (a job log) or a pipe.
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    env = {"PYTHONUNBUFFERED": "1", **job_env(import_path or []), **({VERBOSE_ENV: "1"} if verbose else {})}
    # No RAY_ADDRESS: an embedded Ray of our own ("local"), never a cluster that some other
    # process happens to run on this machine (what address=None would join), ending with this
    # process however it ends (`reaper`), with token authentication as Ray's default has it.
    if not address:
        token_auth_without_warning()
    with contextlib.nullcontext() if address else reaper.ending_with_this_process():
        context = ray.init(
            address=address or "local",
            namespace=NAMESPACE,
            runtime_env={"env_vars": env},
            logging_level=logging.INFO if verbose else logging.WARNING,
        )
    if not verbose:
        drop_ray_noise()
    stop_signal.raise_on_sigterm()  # after ray.init, whose handlers it replaces
    return None if address else context.dashboard_url or None


def job_env(import_path: list[str]) -> dict[str, str]:
    from service import workloads

    return {**workloads.ray_env(import_path), **train_poll_env()}


TRAIN_POLL_ENV, TRAIN_POLL_S = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2"
"""How often Ray Train's controller polls its workers. A worker's report waits for the next
poll once its one unread report slot is full, so at Ray's default (2 s) every evaluation of a
multi-worker trial after the first few waited up to that long (docs/performance.md)."""


def train_poll_env() -> dict[str, str]:
    """The controller's poll interval for every process of the job: the driver's own value when
    it has one, else TRAIN_POLL_S; nothing when the Ray job's runtime env sets it (Ray refuses
    a second value)."""
    from service.workloads import job_env_vars

    if TRAIN_POLL_ENV in job_env_vars():
        return {}
    return {TRAIN_POLL_ENV: os.environ.get(TRAIN_POLL_ENV, TRAIN_POLL_S)}


def check_eval_cluster(study: spec.Study, num_workers: int | None) -> None:
    """The connected Ray cluster can hold `playbook eval`'s workers: the study's layout, or
    `--num-workers` on any hosts (refused before it starts; left to Ray, the run waited for
    them forever). An evaluation starts no Ray Data input workers."""
    import ray

    from service.orchestration.offline_eval import eval_scaling
    from service.study.checks import check_resources

    scaling = eval_scaling(study.scaling, num_workers)
    evaluated = dataclasses.replace(
        study, scaling=scaling, input=dataclasses.replace(study.input, workers="local")
    )
    check_resources(
        evaluated, ray.nodes(), "scaling.workers_per_host" if num_workers is None else "--num-workers"
    )


def check_cluster(study: spec.Study) -> None:
    """The connected Ray cluster can hold one trial of the study (refused before it starts)."""
    import ray

    from service.orchestration.ray_private import cluster_config
    from service.study.checks import autoscaler_nodes, check_resources

    # An autoscaling cluster is judged by what it can grow to, a fixed one by what it has.
    check_resources(study, autoscaler_nodes(cluster_config(), study) or ray.nodes())
