"""Ghost batch normalization: BatchNorm statistics over virtual batches.

BatchNorm normalises each example with the mean and variance of the batch it arrives in, so
its behaviour (the noise in those statistics, and so its regularising effect) changes with the
per-device batch size. The Deep Learning Tuning Playbook points out that this couples BN to
the batch size, and that the number of examples BN computes statistics over is better treated
as its own hyperparameter: ghost batch norm computes the statistics over "virtual" batches of
a chosen number of examples (the playbook's anecdote: 64) whatever the batch size, so that
changing the batch size does not silently change BN.

In training mode a `GhostBatchNorm1d` / `GhostBatchNorm2d` computes its statistics over exactly
`virtual_batch_size` examples, one of two ways:

- per-worker batch >= virtual batch: dim 0 is split into consecutive chunks of
  `virtual_batch_size`, each normalised by ordinary BatchNorm in turn; the running statistics
  are updated once per chunk, as if the chunks were consecutive batches (momentum, the
  cumulative average of momentum=None, and num_batches_tracked alike). The batch must be a
  whole number of virtual batches: a remainder chunk (80 = 64 + 16) raises ValueError.
- per-worker batch < virtual batch: the layer is given a process group of consecutive ranks
  whose batches add up to the virtual batch (`ghost_group`); the per-channel sums are
  all-reduced within the group, so the statistics (and their gradient, as in torch's
  SyncBatchNorm) are those of BatchNorm over the group's concatenated batch. The running
  statistics are updated once per step with those statistics, identically on the group's ranks.

In eval mode it is plain BatchNorm (running statistics; no group, any batch size). The layers
add no parameters or buffers: their state_dict is that of the BatchNorm they replace, so
checkpoints load either way, and `service.nn.batchnorm.sync_batchnorm_stats` treats them as
any BatchNorm.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d)


class _GroupSum(torch.autograd.Function):
    """Sum over the ranks of a process group. Every rank's output is that sum, so the gradient
    of each rank's input is the sum of the output gradients of all the group's ranks."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        total = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        total = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=ctx.group)
        return total, None


class _GhostMixin:
    """Training-mode forward over virtual batches; put before the BatchNorm class in the bases."""

    def __init__(self, *args, virtual_batch_size: int = 64, group=None, **kwargs):
        if virtual_batch_size <= 0:
            raise ValueError(f"virtual_batch_size must be > 0 (got {virtual_batch_size})")
        super().__init__(*args, **kwargs)
        self.virtual_batch_size = virtual_batch_size
        self.group = group
        self.group_size = 1 if group is None else dist.get_world_size(group)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(input)
        self._check_input_dim(input)
        n, virtual = input.shape[0], self.virtual_batch_size
        if self.group is not None:
            if n * self.group_size != virtual:
                raise ValueError(
                    f"ghost batch norm: {self.group_size} ranks' batches of {n} do not make a "
                    f"virtual batch of {virtual}"
                )
            return self._group_forward(input)
        if n == 0 or n % virtual:
            raise ValueError(
                f"ghost batch norm: a batch of {n} is not a whole number of virtual batches of {virtual}"
            )
        # One BatchNorm call per chunk: its own statistics, one running-stat update each, in order.
        chunks = input.split(virtual, dim=0)
        return torch.cat([super(_GhostMixin, self).forward(c) for c in chunks], dim=0)

    def _group_forward(self, x: torch.Tensor) -> torch.Tensor:
        """BatchNorm over the group's concatenated batch: per-channel sums all-reduced in the group."""
        dims = [0, *range(2, x.dim())]
        shape = (1, -1) + (1,) * (x.dim() - 2)
        count = x.numel() // x.shape[1] * self.group_size
        if count < 2:
            raise ValueError(f"ghost batch norm: expected more than 1 value per channel (got {count})")
        h = x.to(torch.promote_types(x.dtype, torch.float32))  # statistics at least in float32
        mean = _GroupSum.apply(h.sum(dims), self.group) / count
        centred = h - mean.view(shape)
        var = _GroupSum.apply((centred * centred).sum(dims), self.group) / count
        y = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach() * (count / (count - 1)))
        return y.to(x.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, unbiased_var: torch.Tensor) -> None:
        """nn.BatchNorm's update: momentum, or with momentum=None the cumulative average."""
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
        self.running_var.lerp_(unbiased_var.to(self.running_var.dtype), factor)

    def extra_repr(self) -> str:
        ghost = f"virtual_batch_size={self.virtual_batch_size}, group_size={self.group_size}"
        return f"{super().extra_repr()}, {ghost}"


class GhostBatchNorm1d(_GhostMixin, nn.BatchNorm1d):
    """`nn.BatchNorm1d` whose training-mode statistics come from virtual batches of
    `virtual_batch_size` examples (keyword argument; default 64), over the ranks of `group`
    when given."""


class GhostBatchNorm2d(_GhostMixin, nn.BatchNorm2d):
    """`nn.BatchNorm2d` whose training-mode statistics come from virtual batches of
    `virtual_batch_size` examples (keyword argument; default 64), over the ranks of `group`
    when given."""


def ghost_group(per_worker_batch: int, virtual_batch_size: int):
    """The process group whose ranks' batches make one virtual batch: consecutive ranks, groups
    of virtual_batch_size / per_worker_batch (every rank must call this; torch creates each
    group on all ranks). None when each worker's batch splits into virtual batches itself.
    Raises ValueError when neither divides the other or the groups do not tile the world."""
    if per_worker_batch >= virtual_batch_size:
        if per_worker_batch % virtual_batch_size:
            raise ValueError(
                f"virtual batch {virtual_batch_size} does not divide the per-worker batch {per_worker_batch}"
            )
        return None
    if virtual_batch_size % per_worker_batch:
        raise ValueError(
            f"virtual batch {virtual_batch_size} is not a whole number of per-worker batches "
            f"of {per_worker_batch}"
        )
    if not dist.is_initialized():
        raise ValueError(
            f"a virtual batch of {virtual_batch_size} over per-worker batches of {per_worker_batch} "
            "needs a process group"
        )
    group, _ = dist.new_subgroups(virtual_batch_size // per_worker_batch)
    return group


def has_batchnorm(model: nn.Module) -> bool:
    """Whether `model` (or any submodule) is an `nn.BatchNorm1d` or `nn.BatchNorm2d`."""
    return any(isinstance(m, _BATCHNORMS) for m in model.modules())


def convert_to_ghost(model: nn.Module, virtual_batch_size: int, group=None) -> nn.Module:
    """Replace every BatchNorm1d/BatchNorm2d in `model` (recursively, in place) by its ghost
    version sharing the same parameter and buffer tensors, eps, momentum, affine and
    track_running_stats, with statistics over the ranks of `group` when given (`ghost_group`).
    Returns `model`, or the new layer if `model` itself is a BatchNorm. Raises ValueError if
    there is no such layer."""
    if virtual_batch_size <= 0:
        raise ValueError(f"virtual_batch_size must be > 0 (got {virtual_batch_size})")
    if not has_batchnorm(model):
        raise ValueError(
            f"{type(model).__name__} has no BatchNorm1d/BatchNorm2d layer to turn into ghost batch norm"
        )
    return _convert(model, virtual_batch_size, group)


def _convert(module: nn.Module, virtual_batch_size: int, group) -> nn.Module:
    if isinstance(module, _BATCHNORMS):
        cls = GhostBatchNorm1d if isinstance(module, nn.BatchNorm1d) else GhostBatchNorm2d
        ghost = cls(
            module.num_features,
            eps=module.eps,
            momentum=module.momentum,
            affine=module.affine,
            track_running_stats=module.track_running_stats,
            virtual_batch_size=virtual_batch_size,
            group=group,
            device="meta",  # placeholders only: every tensor is replaced by the original's below
        )
        ghost._parameters.update(module._parameters)
        ghost._buffers.update(module._buffers)
        ghost._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
        ghost.train(module.training)
        return ghost
    for name, child in module.named_children():
        new = _convert(child, virtual_batch_size, group)
        if new is not child:
            setattr(module, name, new)
    return module
