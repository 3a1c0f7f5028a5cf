"""BatchNorm running statistics across ranks.

Each rank's BN layers accumulate running statistics from its own batches. Before every eval
and checkpoint they are combined over all ranks: the mean of running_mean, and for running_var
the variance of the union (mean of the per-rank variances plus the variance of the per-rank
means), as for equal-sized groups. DDP's `broadcast_buffers` would instead copy rank 0's
statistics to everyone, which evaluates and saves one device's statistics only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def sync_batchnorm_stats(model: nn.Module) -> None:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    world = dist.get_world_size()
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
            mean, var = module.running_mean, module.running_var
            # Square in float64: E[m^2] - E[m]^2 cancels badly for large means in float32.
            mean64 = mean.to(torch.float64)
            stacked = torch.stack([mean64, var.to(torch.float64), mean64 * mean64])
            dist.all_reduce(stacked, op=dist.ReduceOp.SUM)
            stacked /= world
            combined_mean = stacked[0]
            combined_var = stacked[1] + stacked[2] - combined_mean * combined_mean
            mean.copy_(combined_mean.to(mean.dtype))
            var.copy_(combined_var.clamp_min(0).to(var.dtype))
