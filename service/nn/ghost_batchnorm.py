"""Ghost batch normalization: BatchNorm statistics over virtual batches.

BatchNorm normalises each example with the mean and variance of the batch it arrives in, so
its behaviour (the noise in those statistics, and so its regularising effect) changes with the
per-device batch size. The Deep Learning Tuning Playbook points out that this couples BN to
the batch size, and that the number of examples BN computes statistics over is better treated
as its own hyperparameter: ghost batch norm splits each per-device batch into "virtual"
batches (the playbook's anecdote: 64 examples) and normalises each with its own statistics,
so that changing the batch size does not silently change BN.

In training mode a `GhostBatchNorm1d` / `GhostBatchNorm2d` splits dim 0 into consecutive
chunks of `virtual_batch_size` (the last one smaller when it does not divide the batch) and
runs ordinary BatchNorm on each chunk in turn. The running statistics are therefore updated
once per chunk, as if the chunks were consecutive batches (momentum, the cumulative average of
momentum=None, and num_batches_tracked alike). In eval mode it is plain BatchNorm. The layers
add no parameters or buffers: their state_dict is that of the BatchNorm they replace, so
checkpoints load either way, and `service.nn.batchnorm.sync_batchnorm_stats` treats them as
any BatchNorm.

Note: as with plain BatchNorm, a chunk with a single value per channel cannot be normalised in
training mode (a BatchNorm1d on [N, C] input whose N leaves a remainder of 1 raises ValueError).
"""

from __future__ import annotations

import torch
from torch import nn

_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d)


class _GhostMixin:
    """Training-mode forward over virtual batches; put before the BatchNorm class in the bases."""

    def __init__(self, *args, virtual_batch_size: int = 64, **kwargs):
        if virtual_batch_size <= 0:
            raise ValueError(f"virtual_batch_size must be > 0 (got {virtual_batch_size})")
        super().__init__(*args, **kwargs)
        self.virtual_batch_size = virtual_batch_size

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or input.shape[0] <= self.virtual_batch_size:
            return super().forward(input)
        self._check_input_dim(input)
        # One BatchNorm call per chunk: its own statistics, one running-stat update each, in order.
        chunks = input.split(self.virtual_batch_size, dim=0)
        return torch.cat([super(_GhostMixin, self).forward(c) for c in chunks], dim=0)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, virtual_batch_size={self.virtual_batch_size}"


class GhostBatchNorm1d(_GhostMixin, nn.BatchNorm1d):
    """`nn.BatchNorm1d` whose training-mode statistics come from virtual batches of
    `virtual_batch_size` examples (keyword argument; default 64)."""


class GhostBatchNorm2d(_GhostMixin, nn.BatchNorm2d):
    """`nn.BatchNorm2d` whose training-mode statistics come from virtual batches of
    `virtual_batch_size` examples (keyword argument; default 64)."""


def has_batchnorm(model: nn.Module) -> bool:
    """Whether `model` (or any submodule) is an `nn.BatchNorm1d` or `nn.BatchNorm2d`."""
    return any(isinstance(m, _BATCHNORMS) for m in model.modules())


def convert_to_ghost(model: nn.Module, virtual_batch_size: int) -> nn.Module:
    """Replace every BatchNorm1d/BatchNorm2d in `model` (recursively, in place) by its ghost
    version sharing the same parameter and buffer tensors, eps, momentum, affine and
    track_running_stats. Returns `model`, or the new layer if `model` itself is a BatchNorm.
    Raises ValueError if there is no such layer."""
    if virtual_batch_size <= 0:
        raise ValueError(f"virtual_batch_size must be > 0 (got {virtual_batch_size})")
    if not has_batchnorm(model):
        raise ValueError(
            f"{type(model).__name__} has no BatchNorm1d/BatchNorm2d layer to turn into ghost batch norm"
        )
    return _convert(model, virtual_batch_size)


def _convert(module: nn.Module, virtual_batch_size: int) -> nn.Module:
    if isinstance(module, _BATCHNORMS):
        cls = GhostBatchNorm1d if isinstance(module, nn.BatchNorm1d) else GhostBatchNorm2d
        ghost = cls(
            module.num_features,
            eps=module.eps,
            momentum=module.momentum,
            affine=module.affine,
            track_running_stats=module.track_running_stats,
            virtual_batch_size=virtual_batch_size,
            device="meta",  # placeholders only: every tensor is replaced by the original's below
        )
        ghost._parameters.update(module._parameters)
        ghost._buffers.update(module._buffers)
        ghost._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
        ghost.train(module.training)
        return ghost
    for name, child in module.named_children():
        new = _convert(child, virtual_batch_size)
        if new is not child:
            setattr(module, name, new)
    return module
