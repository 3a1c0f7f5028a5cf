"""Running the trainer loop on every rank of a gloo group with the `lm` workload under
`scaling.strategy` ddp or fsdp, its checkpoints kept in a store (sharded under fsdp), as the
Ray edge runs a multi-worker trial."""

from __future__ import annotations

import copy
import pathlib

from service.distributed.checkpoint_store import AsyncCheckpointer, CheckpointStore, SyncCheckpointer
from service.distributed.sharded import ShardedCheckpointStore
from service.distributed.topology import Topology
from service.planning.trial import TrialPlan
from service.study import spec
from service.workloads.base import no_weight_decay_groups
from service.workloads.lm import LanguageModel

SEQ_LEN = 24
LM_HPARAMS = {"learning_rate": 0.003, "depth": 2, "width": 30, "heads": 2, "context": SEQ_LEN}
"""Width 30 over 2 or 4 ranks: the embeddings' 257 rows and most dimensions do not divide."""


class Interrupted(Exception):
    """Raised by `StoreReporter` after a given report (a killed worker group)."""


DIGITS_HPARAMS = {"learning_rate": 0.1, "momentum": 0.9, "width": 6}


def lm_plan(data_dir, storage, strategy="fsdp", workers=2, hparams=None, scaling=None, **training):
    """A 12-step `lm` trial over `workers` ranks (AdamW, evaluations every 4 steps)."""
    return trial_plan("lm", data_dir, storage, strategy, workers, hparams or LM_HPARAMS, scaling, **training)


def digits_plan(data_dir, storage, strategy="fsdp", workers=2, scaling=None, **training):
    """A 12-step `digits` trial (its conv net has BatchNorm) over `workers` ranks (Nesterov)."""
    training = {"batch_size": 32, "eval_batch_size": 64, "optimizer": "nesterov", **training}
    return trial_plan("digits", data_dir, storage, strategy, workers, DIGITS_HPARAMS, scaling, **training)


def trial_plan(workload, data_dir, storage, strategy, workers, hparams, scaling, **training) -> TrialPlan:
    tr = {
        "max_train_steps": 12,
        "batch_size": 8,
        "eval_batch_size": 12,
        "eval_every_steps": 4,
        "metric": "validation/loss",
        "optimizer": "adamw",
        "schedule": {"kind": "cosine", "warmup_steps": 2},
        "num_checkpoints_to_keep": 2,
    }
    tr.update(training)
    study = spec.load_dict(
        {
            "name": "fsdp",
            "workload": workload,
            "data": {s: str(pathlib.Path(data_dir) / s) for s in ("train", "validation")},
            "storage": str(storage),
            "scaling": {"workers_per_host": workers, "strategy": strategy, **(scaling or {})},
            "training": tr,
            "search": {"learning_rate": {"role": "fixed", "value": 0.003}},
            "rounds": [{"name": "r1", "num_trials": 1}],
        }
    )
    return TrialPlan(study, "r1-0", "r1", dict(hparams))


class StoreReporter:
    """Records every report; resumes from the trial's store (every rank), as the Ray edge does."""

    def __init__(self, store, stop_after: int | None = None):
        self.store, self.stop_after, self.metrics = store, stop_after, []

    def report(self, metrics, checkpoint_dir):
        self.metrics.append(copy.deepcopy(metrics))
        if self.stop_after is not None and len(self.metrics) == self.stop_after:
            raise Interrupted

    def restore(self):
        return self.store.latest_state()


def trial_store(plan: TrialPlan, rank: int):
    tr = plan.study.training
    if plan.study.scaling.strategy == "fsdp":
        return ShardedCheckpointStore(plan.trial_uri, tr.num_checkpoints_to_keep, tr.metric, tr.mode, rank)
    return CheckpointStore(plan.trial_uri, tr.num_checkpoints_to_keep, tr.metric, tr.mode, clean=rank == 0)


def train_rank(
    rank: int, world: int, plan: TrialPlan, stop_after: int | None = None, async_save=False
) -> dict:
    """The trial on this rank of a gloo group (hosts x workers as the plan's scaling says);
    returns its reports (or those before the interruption)."""
    from service.trainer.loop import train

    s = plan.study.scaling
    topo = Topology(
        world_rank=rank,
        world_size=world,
        host_rank=rank // s.workers_per_host,
        num_hosts=world // s.workers_per_host,
        local_rank=rank % s.workers_per_host,
        workers_per_host=s.workers_per_host,
    )
    store = trial_store(plan, rank)
    reporter = StoreReporter(store, stop_after)
    saver = AsyncCheckpointer(store) if async_save else SyncCheckpointer(store)
    try:
        train(plan, topo, reporter, checkpointer=saver)
    except Interrupted:
        pass
    return {"metrics": reporter.metrics, "seen": list(SEEN)}


class GradSeenLM(LanguageModel):
    """The `lm` workload noting, at each forward pass on this rank, whether any parameter (a
    shard, under fsdp) holds a gradient yet: between a step's microbatches none may, as long as
    the gradients are not reduced (FSDP keeps the unreduced ones beside the shards)."""

    name = "grad_seen_lm"

    def forward(self, model, batch):
        SEEN.append(any(p.grad is not None for p in model.parameters()))
        return super().forward(model, batch)


SEEN: list[bool] = []


class DecayGroupsLM(LanguageModel):
    """The `lm` workload with two parameter groups: matrices decayed, biases and norms not."""

    name = "decay_groups_lm"

    def param_groups(self, model, hparams):
        return no_weight_decay_groups(model)
