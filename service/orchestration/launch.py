"""Ray edge of a trial: the Tune trial function builds a Ray Train `TorchTrainer` over
hosts x workers, and each Train worker runs the plain-PyTorch loop in `trainer.loop`. A trial
of one worker takes the fast path instead (`fast_path`: the loop inside the Tune trial)."""

from __future__ import annotations

import io
import json

import pyarrow.fs as pafs
import ray
import ray.train
import torch.distributed as dist
from ray.train import Checkpoint, CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig

from service.core import storage
from service.core.errors import CheckpointError
from service.distributed import checkpoint, fence
from service.distributed.checkpoint import TrialState
from service.distributed.topology import Topology, rank_topology
from service.orchestration import fast_path
from service.orchestration.ray_private import final_error_of, report_to_tune, trainer_class
from service.orchestration.trial_summary import (
    failed_summary,
    kept_summary,
    prune_unregistered,
    remove_uncommitted_checkpoints,
    summarize,
)
from service.orchestration.tune_run import is_fast_path, placement_strategy, reuses_workers, worker_env
from service.orchestration.worker_console import (
    log_known_warnings,
    quiet_exit_on_sigterm,
    quiet_train_console,
)
from service.planning.trial import TrialPlan
from service.study.layout import CHECKPOINT_PREFIX
from service.study.spec import Study
from service.trainer import loop

MAX_WORKER_GROUP_RESTARTS = 2


class RayTrainReporter:
    """`loop.Reporter` on Ray Train: reports are barriers across ranks; rank 0 alone passes a
    checkpoint directory, which Ray persists to the trial's storage and ranks for retention.
    Rank 0 holds the worker group's attempt at the trial (`distributed.fence`): a group that a later
    one superseded uploads no checkpoint."""

    def __init__(self, trial_uri: str, attempt: fence.Attempt | None = None):
        self.trial_uri, self.attempt = trial_uri, attempt

    def report(self, metrics: dict, checkpoint_dir: str | None) -> None:
        if checkpoint_dir and self.attempt is not None:
            self.attempt.check("checkpoint")
        ckpt = Checkpoint.from_directory(checkpoint_dir) if checkpoint_dir else None
        ray.train.report(metrics, checkpoint=ckpt)

    def restore(self) -> TrialState | None:
        ckpt = ray.train.get_checkpoint()
        if ckpt is None:  # Ray knows none: none yet, or its record was torn (`drop_torn_record`)
            fs, path = storage.ray_storage(self.trial_uri)
            found = newest_committed_in(fs or pafs.LocalFileSystem(), path)
            return found and found[1]
        with ckpt.as_directory() as d:
            try:
                return checkpoint.load(d)
            except CheckpointError as e:
                # Ray's latest registered checkpoint is torn on storage: resume from the newest
                # committed one beside it instead (never from a half-written one).
                fallback = newest_committed_sibling(ckpt.filesystem, ckpt.path)
                if fallback is None:
                    raise
                where, state = fallback
                print(f"warning: {e}; resuming from {where}", flush=True)
                return state


def newest_committed_sibling(fs: pafs.FileSystem, path: str) -> tuple[str, TrialState] | None:
    """The newest committed checkpoint among the siblings of the one at `path`, read through
    Ray's storage filesystem (local, or gs:// wrapped by `storage.ray_storage`): (path, state)."""
    return newest_committed_in(fs, path.rstrip("/").rsplit("/", 1)[0])


def newest_committed_in(fs: pafs.FileSystem, parent: str) -> tuple[str, TrialState] | None:
    """The newest committed checkpoint in the folder `parent` (None where there is none)."""
    folders = [
        info.path
        for info in fs.get_file_info(pafs.FileSelector(parent, allow_not_found=True))
        if info.type == pafs.FileType.Directory and info.base_name.startswith(CHECKPOINT_PREFIX)
    ]

    def reader_for(folder: str):
        def read(name: str) -> bytes:
            with fs.open_input_stream(f"{folder}/{name}") as f:
                return f.read()

        return read

    found = checkpoint.newest_committed(folders, reader_for)
    if found is None:
        return None
    folder, files = found
    return folder, checkpoint.load_file(io.BytesIO(files[checkpoint.STATE_FILE]))


def worker_topology() -> Topology:
    """This worker's place: host and local rank from the Ray node ids of the whole worker
    group, in world-rank order (`topology.rank_topology`)."""
    ctx = ray.train.get_context()
    world_rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    node_ids = [ray.get_runtime_context().get_node_id()]
    if world_size > 1:
        node_ids = [None] * world_size
        dist.all_gather_object(node_ids, ray.get_runtime_context().get_node_id())
    return rank_topology(node_ids, world_rank)


def train_worker(config: dict) -> None:
    import ray.train.torch

    quiet_train_console()
    log_known_warnings()
    quiet_exit_on_sigterm()
    plan: TrialPlan = config["plan"]
    topo = worker_topology()
    attempt = group_attempt(plan, topo)
    device, source = ray.train.torch.get_device(), batch_source(plan.study)
    if plan.study.scaling.strategy != "fsdp":
        reporter = RayTrainReporter(plan.trial_uri, attempt if topo.is_rank0 else None)
        loop.train(plan, topo, reporter, device, source)
        return
    fast_path.train_rank(plan, topo, device, source, ray.train.report, attempt)  # its shards in its store


def group_attempt(plan: TrialPlan, topo: Topology) -> fence.Attempt:
    """The worker group's attempt at the trial: claimed by rank 0 and held by every rank, so
    that no rank of a superseded group writes into the trial folder (a sharded checkpoint's
    shards are written by every rank)."""
    box = [fence.claim(plan.trial_uri) if topo.is_rank0 else None]
    if topo.world_size > 1:
        dist.broadcast_object_list(box, src=0)
    fence.hold(box[0])
    return box[0]


def batch_source(study: Study) -> loop.BatchSource | None:
    """Input worker processes or Ray Data input workers when the study asks for them (else
    the loop's own prefetch)."""
    inp = study.input
    if inp.workers == "processes":
        from service.data.process_input import process_source

        return process_source(inp.num_input_workers)
    if inp.workers != "ray_data":
        return None
    from service.orchestration.ray_input import ray_data_source

    return ray_data_source(inp.num_input_workers, inp.cpus_per_input_worker, inp.prefetch_batches)


def scaling_config(scaling) -> ScalingConfig:
    """hosts x workers per host; one CPU share (and a GPU when asked) per worker."""
    gpu = {"GPU": 1} if scaling.use_gpu else {}
    return ScalingConfig(
        num_workers=scaling.world_size,
        use_gpu=scaling.use_gpu,
        resources_per_worker={"CPU": scaling.cpus_per_worker, **gpu},
        placement_strategy=placement_strategy(scaling),
    )


def torch_config(scaling):
    """The worker group's torch.distributed set-up: its collectives fail after
    `scaling.collective_timeout_s` (gloo and NCCL alike; Ray Train turns on NCCL's async error
    handling, so a timed-out NCCL collective ends the process too)."""
    from ray.train.torch import TorchConfig

    return TorchConfig(timeout_s=scaling.collective_timeout_s)


RAY_TRAIN_RECORD = "checkpoint_manager_snapshot.json"
"""Ray Train's record of a run's checkpoints, in the run's folder (the trial's)."""
TORN_SUFFIX = ".torn"
"""Added to the name of a record found torn (`drop_torn_record`)."""


def drop_torn_record(plan: TrialPlan) -> bool:
    """Ray Train writes its record of the trial's checkpoints in place: a write that met a full
    disk leaves it cut short, and Ray Train's controller then cannot start. Such a record is moved
    aside (to `<record>.torn`): the trial resumes from its newest committed checkpoint
    (`RayTrainReporter.restore`). Returns whether the trial's record was ever torn: Ray's new
    record knows only the checkpoints of the runs since, so the trial's own store chooses what is
    kept (`fit_and_keep`), on this run and on any later one."""
    uri = storage.join(plan.trial_uri, RAY_TRAIN_RECORD)
    torn = uri + TORN_SUFFIX
    try:
        json.loads(storage.read_bytes(uri))
    except FileNotFoundError:
        pass
    except ValueError:
        print(
            f"[{plan.trial_name}] warning: {uri} was cut short; resuming from the newest committed checkpoint"
        )
        fs, path = storage.split(uri)
        fs.mv(path, storage.split(torn)[1])  # a rename: it needs no more room on a disk still full
    return storage.exists(torn)


def trainer_for(plan: TrialPlan, in_tune: bool):
    from ray.tune.integration.ray_train import TuneReportCallback

    study = plan.study
    scaling = study.scaling
    fs, trials_path = storage.ray_storage(study.layout.trials_dir)
    return trainer_class()(
        train_worker,
        train_loop_config={"plan": plan},
        torch_config=torch_config(scaling),
        scaling_config=scaling_config(scaling),
        run_config=RunConfig(
            name=plan.trial_name,
            storage_path=trials_path,
            storage_filesystem=fs,
            # Ray keeps the N best reports by the metric (the later one on a tie, as `trial.rank`
            # ranks them) plus the latest.
            checkpoint_config=CheckpointConfig(
                num_to_keep=study.training.num_checkpoints_to_keep,
                checkpoint_score_attribute=study.training.metric,
                checkpoint_score_order=study.training.mode,
            ),
            failure_config=FailureConfig(max_failures=MAX_WORKER_GROUP_RESTARTS),
            callbacks=[TuneReportCallback()] if in_tune else [],
            # Ray Train's per-report INFO lines would drown the coordinator's progress lines in
            # the job log; they still go to Ray's log files.
            logging_config=LoggingConfig(log_level="WARNING"),
            worker_runtime_env={"env_vars": worker_env(scaling)},
        ),
    )


def tune_trial(config: dict, study: Study) -> None:
    """One Tune trial = one Ray Train run (or, for one worker, the loop in this process). Its
    last Tune report is the trial summary."""
    quiet_exit_on_sigterm()
    plan = TrialPlan.from_config(study, config["trial"])
    try:
        summary = train_trial(plan)
    except Exception as e:
        error = final_error_of(e, plan.trial_uri)
        if error is None:
            raise  # Tune retries it (TuneRun's FailureConfig)
        summary = failed_summary(plan, error)
    report_to_tune({**summary, "summary": True})


def train_trial(plan: TrialPlan) -> dict:
    if is_fast_path(plan.study.scaling):
        return kept_summary(plan, fast_path.train_in_trial(plan, batch_source(plan.study)))
    if reuses_workers(plan.study):
        from service.orchestration import worker_pool

        return kept_summary(plan, worker_pool.train_in_pool(plan, batch_source(plan.study)))
    result, kept = fit_and_keep(plan, in_tune=True)
    return summarize(plan, result) if kept is None else kept_summary(plan, kept)


def fit_and_keep(plan: TrialPlan, in_tune: bool):
    """The trial as a Ray Train run, then its checkpoints pruned to those kept. Returns Ray's
    result and, where the trial's own store chose what is kept (under fsdp, or after Ray's
    record was torn), their (URI, meta); None where Ray's retention chose."""
    torn = drop_torn_record(plan)
    result = trainer_for(plan, in_tune).fit()
    if plan.study.scaling.strategy == "fsdp":  # its checkpoints were kept by its store, not Ray
        return result, fast_path.trial_store(plan).complete()
    if torn:  # Ray knows only the checkpoints since: the trial's store keeps the best of all
        remove_uncommitted_checkpoints(plan)  # what prune_unregistered removes on the Ray path
        return result, fast_path.trial_store(plan).retained()
    prune_unregistered(plan, result)
    return result, None


def run_single(plan: TrialPlan):
    """One trial as a plain Ray Train run, outside Tune (whatever its world size)."""
    return fit_and_keep(plan, in_tune=False)[0]
