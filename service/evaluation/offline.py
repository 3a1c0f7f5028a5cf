"""`playbook eval CHECKPOINT_URI --split test`: a saved checkpoint evaluated on a whole split,
sharded by rows over every rank of a Ray Train worker group, with metrics and per-example
predictions written next to the checkpoint's trial (plain PyTorch; the Ray edge is in launch)."""

from __future__ import annotations

import posixpath

import torch
import torch.distributed as dist
from torch import nn

from service import workloads
from service.core import storage
from service.core.errors import DataError, StorageError
from service.data.files import list_files
from service.data.loader import eval_batches
from service.data.sharding import row_ranges
from service.distributed import sharded, sharding
from service.distributed.checkpoint import TrialState
from service.distributed.rank0 import Rank0
from service.distributed.topology import Topology
from service.evaluation import predictions as prediction_files
from service.evaluation.predictions import PredictionLog
from service.evaluation.run import evaluate
from service.nn.ghost_batchnorm import convert_to_ghost
from service.study import spec
from service.study.layout import StudyLayout, TrialLayout


def locate(checkpoint_uri: str) -> tuple[str, str]:
    """`<study>/trials/<trial>/checkpoint_*` -> (study URI, trial name)."""
    trial = TrialLayout.of_checkpoint(checkpoint_uri)
    return trial.study.uri, trial.name


def stored_study(study_uri: str) -> spec.Study:
    uri = StudyLayout(study_uri).study_file
    if not storage.exists(uri):
        raise StorageError(f"{uri}: no stored study file next to the checkpoint")
    return spec.load_text(storage.read_bytes(uri).decode(), source=uri)


def output_uri(checkpoint_uri: str, split: str) -> str:
    """The folder of `metrics_uri` and `predictions_uri`."""
    return TrialLayout.of_checkpoint(checkpoint_uri).eval_dir(split, _name(checkpoint_uri))


def metrics_uri(checkpoint_uri: str, split: str) -> str:
    return TrialLayout.of_checkpoint(checkpoint_uri).eval_metrics(split, _name(checkpoint_uri))


def predictions_uri(checkpoint_uri: str, split: str) -> str:
    return TrialLayout.of_checkpoint(checkpoint_uri).eval_predictions(split, _name(checkpoint_uri))


def _name(checkpoint_uri: str) -> str:
    return posixpath.basename(checkpoint_uri.rstrip("/"))


def restored_model(study: spec.Study, workload, state: TrialState, device) -> nn.Module:
    """The checkpoint's model on `device`: whole, or for a sharded checkpoint on several ranks
    sharded over all of them as the trial sharded it (its units), each rank reading its part."""
    model = workload.build_model(state.hparams)
    if study.training.ghost_batch_norm:
        convert_to_ghost(model, study.training.virtual_batch_size)
    model.to(device)
    if not state.shards:
        model.load_state_dict(state.model)
        return model
    if dist.is_initialized() and dist.get_world_size() > 1:
        sharding.shard_model(model, workload.shard_units(model), sharding.device_mesh(device))
    sharded.load_shards(state, model)
    return model


def split_uri(study: spec.Study, split: str) -> str:
    uri = getattr(study.data, split, None)
    if not uri:
        raise DataError(f"data.{split}: the study has no {split} split")
    return uri


def evaluate_checkpoint(checkpoint_uri: str, split: str, topo: Topology, device=None) -> dict:
    """Run on every rank; rank 0 writes `metrics.json` and `predictions.parquet` and every rank
    returns the metrics. The ranks need not be the trial's: a sharded checkpoint is resharded
    over them, or read whole by a single one."""
    device = device or torch.device("cpu")
    study_uri, _ = locate(checkpoint_uri)
    study = stored_study(study_uri)
    state = sharded.load_state(checkpoint_uri, topo.world_rank, topo.world_size)
    workload = workloads.get(study.workload)
    model = restored_model(study, workload, state, device)
    batch_size = study.training.resolved_eval_batch_size // study.scaling.world_size
    ranges = row_ranges(list_files(split_uri(study, split)), topo.world_rank, topo.world_size)
    log = PredictionLog.of(workload)
    metrics = evaluate(model, workload, eval_batches(workload, ranges, batch_size), batch_size, device, log)
    metrics.update(
        {"checkpoint": checkpoint_uri, "split": split, "step": state.step, "world_size": topo.world_size}
    )
    rows = log.gather()
    rank0 = Rank0(topo)
    rank0.run(prediction_files.write, predictions_uri(checkpoint_uri, split), rows, split, state.step)
    rank0.run(storage.write_json, metrics_uri(checkpoint_uri, split), metrics)
    return metrics
