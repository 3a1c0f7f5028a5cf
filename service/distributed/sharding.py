"""How a multi-worker trial spreads its model (`scaling.strategy`), in one place: DDP's whole
replicas, or FSDP2's shards (`fully_shard` applied to each of the workload's units, then to the
root; HSDP over a 2-D device mesh with `scaling.shard_group_size`). The model file never
mentions either: the workload only names its units (`Workload.shard_units`).

Also what differs between them for the rest of the trial: turning the gradient reduction off
for all but a step's last microbatch, and the state dicts a checkpoint saves and loads (whole
for DDP; for FSDP each rank's shards, keyed by parameter name, as `torch.distributed.checkpoint`
writes and reshards them)."""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIMS = ("replicate", "shard")

# torch's FSDP, DTensor and DCP modules are imported where a model is sharded, not at import:
# they take most of a second to import (sympy among them), which every trial process and
# training worker would pay. Until something imported them, no model is sharded.


def dtensor_type() -> type | None:
    """torch's DTensor class once its module is imported (sharding a model imports it), else None."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def is_dtensor(value) -> bool:
    cls = dtensor_type()
    return cls is not None and isinstance(value, cls)


_meshes: dict[tuple, tuple] = {}
"""Meshes made in this process, by (device type, shape): (the default process group they were
made over, the mesh). init_device_mesh makes a process group per dimension of a 2-D mesh, and
nothing ends them before the default group ends; a reused pool's next trial takes the mesh it
already has instead of gathering two more groups per trial."""


def device_mesh(device, shard_group_size: int | None = None) -> DeviceMesh:
    """Every rank of the default process group, as a 1-D mesh (FSDP) or, with a shard group
    smaller than the world, as (replicas, shard_group_size) with consecutive ranks in a group
    (HSDP: a host's workers hold consecutive world ranks, `topology.placement`). The same mesh
    again for the same layout while the default group lasts."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    device_type = torch.device(device).type
    hsdp = shard_group_size is not None and shard_group_size != world
    shape = (world // shard_group_size, shard_group_size) if hsdp else (world,)
    made = _meshes.get((device_type, shape))
    if made is not None and made[0] is dist.group.WORLD:
        return made[1]
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS if hsdp else None)
    _meshes[(device_type, shape)] = (dist.group.WORLD, mesh)
    return mesh


def shard_model(model: nn.Module, units: list[nn.Module], mesh: DeviceMesh, param_dtype=None) -> nn.Module:
    """FSDP2 over `mesh`: each unit sharded on its own, then the root (the parameters of no
    unit), in place. `param_dtype` (bf16): parameters gathered in that dtype for forward and
    backward, gradients reduced in float32; the sharded parameters and the optimizer state
    stay float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None
    )
    for unit in units:
        if unit is model:
            continue
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def is_sharded(model: nn.Module) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


@contextlib.contextmanager
def no_gradient_sync(trained: nn.Module):
    """Backward passes inside accumulate each rank's gradients without reducing them (the
    step's last microbatch, outside, reduces the sum): DDP's `no_sync`, FSDP's
    `set_requires_gradient_sync(False)`."""
    if is_sharded(trained):
        trained.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            trained.set_requires_gradient_sync(True)
    elif isinstance(trained, nn.parallel.DistributedDataParallel):
        with trained.no_sync():
            yield
    else:
        yield


def state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict]:
    """(model, optimizer) state dicts to checkpoint: torch's own for a whole model; for a
    sharded one this rank's shards (DTensors) keyed by parameter name, as torch's
    `get_state_dict` gives them (the same keys and tensors: a test checks it), made directly:
    its generality costs milliseconds of Python per checkpoint, which the loop waits for.
    Without an optimizer, the model's alone (and an empty one)."""
    if not is_sharded(model):
        return model.state_dict(), optimizer.state_dict() if optimizer is not None else {}
    return model.state_dict(), named_optimizer_state(model, optimizer) if optimizer is not None else {}


def named_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state keyed by parameter name (the first, for a tied parameter) instead of
    its position: `{"state": {name: {...}}, "param_groups": [{..., "params": [names]}]}`."""
    names: dict = {}
    for name, param in model.named_parameters():
        names.setdefault(param, name)
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[p] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    return {"state": {names[p]: dict(s) for p, s in optimizer.state.items()}, "param_groups": groups}


def load_targets(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict]:
    """State dicts shaped as `state_dicts` saves them, for `torch.distributed.checkpoint.load`
    to fill: torch's `get_state_dict` for a sharded model, which first gives a fresh optimizer
    its state (zeros) so that every saved tensor has a place to go."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if not is_sharded(model):
        return state_dicts(model, optimizer)
    if optimizer is None:
        return get_model_state_dict(model), {}
    return get_state_dict(model, optimizer)


def load_state_dicts(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, model_sd: dict, optim_sd: dict
) -> None:
    """The inverse of `state_dicts` (for a sharded model: its shards, as `state_dicts` made
    them, filled by `torch.distributed.checkpoint.load`)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    if not is_sharded(model):
        model.load_state_dict(model_sd)
        if optimizer is not None:
            optimizer.load_state_dict(optim_sd)
    elif optimizer is None:
        set_model_state_dict(model, model_sd)
    else:
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
