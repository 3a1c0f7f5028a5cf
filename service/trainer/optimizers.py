"""The built-in optimizers (SGD with momentum, Nesterov, AdamW), built from the trial's
hyperparameters over the workload's parameter groups (`Workload.param_groups`), or the
workload's own (`Workload.optimizer`)."""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from service.core.errors import PlaybookError

GROUP_KEYS = {
    "weight_decay": "weight_decay",
    "momentum": "momentum",
    "eps": "eps",
    "beta1": "betas",
    "beta2": "betas",
}
"""The optimizer option each optimizer hyperparameter sets (a group that gives its own value
keeps the hyperparameter from reaching its parameters)."""


def build_optimizer(name: str, params, hparams: dict) -> torch.optim.Optimizer:
    lr = float(hparams["learning_rate"])
    wd = float(hparams.get("weight_decay", 0.0))
    if name == "adamw":
        betas = (float(hparams.get("beta1", 0.9)), float(hparams.get("beta2", 0.999)))
        eps = float(hparams.get("eps", 1e-8))
        optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=wd)
    else:
        momentum = float(hparams.get("momentum", 0.9))
        nesterov = name == "nesterov"
        optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=wd, nesterov=nesterov)
    foreach_where_exact(optimizer)
    return optimizer


EXACT_FOREACH_DTYPES = (torch.float32, torch.float64)


def foreach_where_exact(optimizer: torch.optim.Optimizer) -> None:
    """torch's foreach path for every group of float32/float64 parameters, on CPU too (torch's
    default on CUDA): one call per group of tensors instead of a Python call per parameter and
    operation. On CPU it runs the same kernels per tensor as the per-parameter loop, so the
    same bits; not for bf16/fp16 parameters, whose foreach multiply rounds otherwise (those
    groups keep torch's default)."""
    for group in optimizer.param_groups:
        if all(p.dtype in EXACT_FOREACH_DTYPES for p in group["params"]):
            group["foreach"] = True


def workload_optimizer(name: str, workload, model: nn.Module, hparams: dict) -> torch.optim.Optimizer:
    """The built-in optimizer `name` (or with `workload` the workload's own) over the workload's
    parameter groups, checked: every
    trainable parameter in exactly one group, no group setting `lr` (the schedule sets every
    group's), only options the optimizer has, and every optimizer hyperparameter of the trial
    reaching at least one group."""
    where = f"workload {workload.name}: param_groups"
    groups = [{**g, "params": list(g["params"])} for g in workload.param_groups(model, hparams)]
    check_covers(groups, model, where)
    if name == "workload":
        optimizer = own_optimizer(workload, groups, hparams)
    else:
        optimizer = build_optimizer(name, [dict(g) for g in groups], hparams)  # torch fills in its copies
    for i, group in enumerate(groups):
        unknown = sorted(set(group) - set(optimizer.defaults) - {"params", "name"})
        if "lr" in group or unknown:
            bad = "lr (the schedule sets every group's)" if "lr" in group else f"{unknown} (not {name}'s)"
            raise PlaybookError(f"{where}[{i}] sets {bad}")
    for hparam, key in GROUP_KEYS.items():
        if hparam in hparams and all(key in g for g in groups):
            raise PlaybookError(f"{where}: every group sets {key}, so {hparam} reaches no parameter")
    return optimizer


def own_optimizer(workload, groups: list[dict], hparams: dict) -> torch.optim.Optimizer:
    """The workload's own optimizer (`training.optimizer: workload`), checked to read every
    optimizer hyperparameter the trial sets: built again with each one changed, its groups'
    options must change."""
    where = f"workload {workload.name}: optimizer"
    optimizer = workload.optimizer([dict(g) for g in groups], hparams)
    if optimizer is None:
        raise PlaybookError(f"{where}: returns None with training.optimizer: workload")
    if "lr" not in optimizer.defaults:
        raise PlaybookError(f"{where}: has no lr option for the learning-rate schedule to set")
    for hparam in (h for h in GROUP_KEYS if h in hparams):
        value = float(hparams[hparam])
        changed = {**hparams, hparam: value + 0.1 if value < 0.5 else value - 0.1}
        other = workload.optimizer([dict(g) for g in groups], changed)
        if _options(other) == _options(optimizer):
            raise PlaybookError(
                f"{where}: does not read {hparam}, which the trial sets (it would reach nothing)"
            )
    return optimizer


def _options(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def check_covers(groups: list[dict], model: nn.Module, where: str) -> None:
    """Every trainable parameter of `model` in exactly one group, and nothing else."""
    listed = Counter(id(p) for g in groups for p in g["params"])
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    if any(n > 1 for n in listed.values()):
        raise PlaybookError(f"{where}: a parameter is in more than one group")
    if set(listed) != trainable:
        missing, extra = len(trainable - set(listed)), len(set(listed) - trainable)
        raise PlaybookError(
            f"{where}: leaves out {missing} of the model's {len(trainable)} trainable parameters"
            + (f" and lists {extra} that are not" if extra else "")
        )
