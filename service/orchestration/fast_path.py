"""The single-worker fast path: a trial of world size 1 trains inside its own Ray Tune function
trial, with no Ray Train controller, worker group or placement group to start (most of a
TorchTrainer.fit's fixed cost, docs/performance.md). What Ray Train did for it is kept:

- reports: every evaluation goes to Tune (`tune.report`), which the coordinator turns into rows;
- checkpoints: written to the same `<study>/trials/<trial>/checkpoint_*` layout, the N best by
  the metric plus the latest (`distributed.checkpoint_store`), in the background when
  `training.async_checkpoint`;
- failures: Tune restarts the trial (`TuneRun`'s `FailureConfig`), and the restarted
  trial resumes from its latest complete checkpoint on storage, which also survives a
  restarted driver (Tune's own `get_checkpoint` would keep a second copy under tune/).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import ray
import ray.tune
import torch

from service.distributed import devices, fence
from service.distributed.checkpoint import TrialState
from service.distributed.checkpoint_store import AsyncCheckpointer, CheckpointStore, SyncCheckpointer
from service.distributed.sharded import ShardedCheckpointStore
from service.distributed.topology import Topology
from service.planning.trial import TrialPlan
from service.trainer import loop


class StoreReporter:
    """`loop.Reporter` of a trial that keeps its checkpoints in a store (the fast path, a pooled
    trial's ranks, a sharded trial): each evaluation's metrics through `report` (Ray Tune's, Ray
    Train's, or none), and a restart resumes from the store's latest complete checkpoint."""

    def __init__(self, store: CheckpointStore, report: Callable[[dict], None] | None):
        self.store, self._report = store, report

    def report(self, metrics: dict, checkpoint_dir: str | None) -> None:
        if self._report is not None:
            self._report(metrics)

    def restore(self) -> TrialState | None:
        return self.store.latest_state()


def trial_store(plan: TrialPlan, rank: int = 0) -> CheckpointStore:
    """The trial's checkpoints; only rank 0's store, the one that saves, clears what a crashed
    save left."""
    tr = plan.study.training
    return CheckpointStore(plan.trial_uri, tr.num_checkpoints_to_keep, tr.metric, tr.mode, clean=rank == 0)


def rank_store(plan: TrialPlan, rank: int) -> CheckpointStore:
    """Where this rank's checkpoints go: its shards of every checkpoint under `fsdp` (every
    rank saves), else the trial's store (rank 0 saves, every rank resumes from it)."""
    if plan.study.scaling.strategy != "fsdp":
        return trial_store(plan, rank)
    tr = plan.study.training
    return ShardedCheckpointStore(plan.trial_uri, tr.num_checkpoints_to_keep, tr.metric, tr.mode, rank)


def train_rank(
    plan: TrialPlan,
    topo: Topology,
    device: torch.device,
    batch_source: loop.BatchSource | None,
    report: Callable[[dict], None] | None,
    attempt: fence.Attempt,
) -> list[tuple[str, dict]]:
    """Train (or resume) one rank of a trial that keeps its checkpoints itself, holding the
    trial's `attempt` (`distributed.fence`); returns its kept checkpoints (URI, meta)."""
    torch.set_num_threads(max(1, int(plan.study.scaling.cpus_per_worker)))
    fence.hold(attempt)
    store = rank_store(plan, topo.world_rank)
    saver = None
    if topo.is_rank0 or store.every_rank:
        saver = AsyncCheckpointer(store) if plan.study.training.async_checkpoint else SyncCheckpointer(store)
    loop.train(plan, topo, StoreReporter(store, report), device, batch_source, checkpointer=saver)
    return store.complete()


def trial_device(scaling) -> torch.device:
    """The trial process's device: the CPU, or the GPU Ray gave it, by its place among those the
    process sees (it alone, or a pool's GPUs on its node: `distributed.devices`)."""
    if not scaling.use_gpu:
        return torch.device("cpu")
    return torch.device("cuda", devices.gpu_index(os.environ.get(devices.VISIBLE_ENV), ray.get_gpu_ids()))


def train_in_trial(
    plan: TrialPlan,
    batch_source: loop.BatchSource | None,
    topo: Topology | None = None,
    attempt: fence.Attempt | None = None,
) -> list[tuple[str, dict]]:
    """Train (or resume) the trial in this process, as world rank 0 of `topo` (a pooled trial,
    `worker_pool`, whose `attempt` it claimed) or alone; returns its kept checkpoints (URI, meta)."""
    # a stranded earlier attempt of this trial writes nothing from now on
    attempt = attempt or fence.claim(plan.trial_uri)
    topo = topo or Topology(node_id=ray.get_runtime_context().get_node_id())
    return train_rank(plan, topo, trial_device(plan.study.scaling), batch_source, ray.tune.report, attempt)
