"""The step loop's device-side sums (`StepTally`) and the all-reduces of its eval points: sums
and minima of host floats over every rank (a no-op in a single process)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class StepTally:
    """An interval's training-loss sum and count (finite losses), its first non-finite step and,
    with gradient clipping, the sum of the gradients' finite global norms (before clipping), the
    number of steps clipped and the number of finite norms (fp16's scaler skips the update of a
    step whose gradients overflowed: its norm is left out), kept as device tensors: adding a step
    reads nothing back to the host, so the step never waits for the device (the playbook: no
    accidental host syncs in the input pipeline's way). `take()` reads them at an eval point, in
    one transfer, and starts the next interval."""

    def __init__(self, device):
        self.device = device
        self._start()

    def _start(self) -> None:
        # loss sum, finite-loss count, finite grad norm sum, clipped steps, finite grad norms
        self.sums = torch.zeros(5, dtype=torch.float64, device=self.device)
        self.first_bad = torch.full((), math.inf, dtype=torch.float64, device=self.device)

    def add(self, loss: torch.Tensor, step: int) -> None:
        value = loss.detach().double()
        finite = torch.isfinite(value)
        self.sums[:2] += torch.stack([torch.where(finite, value, 0.0), finite.double()])
        this_step = torch.full((), float(step), dtype=torch.float64, device=self.device)
        self.first_bad = torch.where(finite, self.first_bad, torch.minimum(self.first_bad, this_step))

    def add_grad_norm(self, norm: torch.Tensor, max_norm: float) -> None:
        """A step's global gradient norm before clipping; clipped when it exceeds `max_norm`."""
        norm = norm.detach().double()
        finite = torch.isfinite(norm)
        clipped = finite & (norm > max_norm)
        self.sums[2:] += torch.stack([torch.where(finite, norm, 0.0), clipped.double(), finite.double()])

    def take(self) -> tuple[float, float, float, float, float, float]:
        """(loss sum, finite steps, finite grad norm sum, clipped steps, finite grad norms, first
        non-finite step or inf) since the last take."""
        *sums, first_bad = torch.cat([self.sums, self.first_bad.view(1)]).tolist()
        self._start()
        return (*sums, first_bad)


def all_reduce_sum(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if distributed():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_reduce_min(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    if distributed():
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return float(t.item())
