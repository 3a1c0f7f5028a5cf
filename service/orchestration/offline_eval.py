"""The Ray edge of `playbook eval`: a Ray Train run whose workers evaluate a checkpoint on a
whole split (`service.evaluation.offline`), over the study's worker layout or another."""

from __future__ import annotations

import dataclasses
import uuid

from ray.train import LoggingConfig, RunConfig

from service.core import storage
from service.orchestration.launch import scaling_config, torch_config, worker_topology
from service.orchestration.worker_console import quiet_train_console
from service.study.spec import Study


def eval_worker(config: dict) -> None:
    import ray.train.torch

    quiet_train_console()
    from service.evaluation.offline import evaluate_checkpoint

    evaluate_checkpoint(
        config["checkpoint_uri"], config["split"], worker_topology(), ray.train.torch.get_device()
    )


def eval_scaling(scaling, num_workers: int | None):
    """The layout `playbook eval` runs on: the study's, or `num_workers` workers on any hosts."""
    if num_workers is None:
        return scaling
    return dataclasses.replace(scaling, num_hosts=1, workers_per_host=num_workers)


def run_offline_eval(checkpoint_uri: str, split: str, study: Study, num_workers: int | None = None) -> None:
    """`playbook eval`: the checkpoint on the whole split, over the study's worker layout or
    over `num_workers` workers on any hosts (a sharded checkpoint is resharded over them). The
    Ray Train run is started from a task on this node that has this cluster's address
    (`actor_options.cluster_env`), as a study's coordinator does."""
    import ray

    from service.orchestration.actor_options import cluster_env, on_this_node

    fit = ray.remote(num_cpus=0)(fit_eval).options(
        runtime_env={"env_vars": cluster_env()}, scheduling_strategy=on_this_node(), max_retries=0
    )
    ray.get(fit.remote(checkpoint_uri, split, study, eval_scaling(study.scaling, num_workers)))


def fit_eval(checkpoint_uri: str, split: str, study: Study, scaling) -> None:
    from ray.train.torch import TorchTrainer

    from service.evaluation.offline import locate

    fs, path = storage.ray_storage(study.layout.evals_dir)
    _, trial = locate(checkpoint_uri)
    TorchTrainer(
        eval_worker,
        train_loop_config={"checkpoint_uri": checkpoint_uri, "split": split},
        torch_config=torch_config(scaling),
        scaling_config=scaling_config(scaling),
        run_config=RunConfig(
            name=f"eval-{trial}-{split}-{uuid.uuid4().hex[:6]}",
            storage_path=path,
            storage_filesystem=fs,
            logging_config=LoggingConfig(log_level="WARNING"),
        ),
    ).fit()
