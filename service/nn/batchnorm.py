"""BatchNorm running statistics across ranks.

Each rank's BN layers accumulate running statistics from its own batches, and in training each
rank normalised with its own batch statistics. The running statistics are linear combinations
of those batch statistics, so before every eval and checkpoint they are averaged over all ranks
(the playbook's rule):

- running_mean and running_var become their mean over the ranks (an average of the ranks'
  averages of batch statistics, not the variance of the union of the ranks' data);
- a layer with `momentum=None` keeps a cumulative average, so its statistics are averaged with
  each rank weighted by its `num_batches_tracked` (the plain mean when, as in training, every
  rank has counted the same batches);
- `num_batches_tracked` becomes the ranks' mean count (rounded), so that a cumulative average
  continued on every rank stays the average over all ranks' batches.

DDP's `broadcast_buffers` would instead copy rank 0's statistics to everyone, which evaluates
and saves one device's statistics only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def sync_batchnorm_stats(model: nn.Module) -> None:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
            _average_over_ranks(module)


def _average_over_ranks(bn: nn.modules.batchnorm._BatchNorm) -> None:
    mean, var, count = bn.running_mean, bn.running_var, bn.num_batches_tracked
    world = dist.get_world_size()
    # One all-reduce per layer, in float64 (exact counts; sums of many ranks' statistics).
    n = count.to(device=mean.device, dtype=torch.float64)
    mean64, var64 = mean.to(torch.float64), var.to(torch.float64)
    sums = torch.cat([mean64, var64, n * mean64, n * var64, n.reshape(1)])
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    c = mean.numel()
    total = sums[-1]
    if bn.momentum is None and total > 0:  # cumulative averages: weight each rank by its count
        new_mean, new_var = sums[2 * c : 3 * c] / total, sums[3 * c : 4 * c] / total
    else:  # EMAs: the plain mean
        new_mean, new_var = sums[:c] / world, sums[c : 2 * c] / world
    mean.copy_(new_mean.to(mean.dtype))
    var.copy_(new_var.to(var.dtype))
    count.fill_(int(torch.round(total / world)))
