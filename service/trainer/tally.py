"""The step loop's device-side sums (`StepTally`) and the all-reduces of its eval points: sums
and minima of host floats over every rank (a no-op in a single process)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class StepTally:
    """An interval's training-loss sum and count (finite losses), its first non-finite step, the
    sum of the gradients' finite global norms (before clipping; every step's, clipped or not),
    the number of steps clipped (none without `grad_clip_norm`) and the number of finite norms
    (fp16's scaler skips the update of a step whose gradients overflowed: its norm is left out).
    A step only keeps its loss and norm as device tensors: it reads nothing back to the host, so
    the step never waits for the device (the playbook: no accidental host syncs in the input
    pipeline's way), and does no arithmetic. `take()` sums them at an eval point, reads the sums
    in one transfer, and starts the next interval."""

    def __init__(self, device):
        self.device = device
        self._start()

    def _start(self) -> None:
        # Each step only keeps its detached loss (and norm): summing them is done once, at take().
        self.losses: list[torch.Tensor] = []
        self.steps: list[int] = []
        self.norms: list[torch.Tensor] = []
        self.max_norm = math.inf

    def add(self, loss: torch.Tensor, step: int) -> None:
        self.losses.append(loss.detach())
        self.steps.append(step)

    def add_grad_norm(self, norm: torch.Tensor, max_norm: float) -> None:
        """A step's global gradient norm before clipping; clipped when it exceeds `max_norm`
        (inf without clipping)."""
        self.norms.append(norm.detach())
        self.max_norm = max_norm

    def take(self) -> tuple[float, float, float, float, float, float]:
        """(loss sum, finite steps, finite grad norm sum, clipped steps, finite grad norms, first
        non-finite step or inf) since the last take."""
        loss_sum, finite_steps, first_bad = self._loss_sums()
        sums = torch.stack([loss_sum, finite_steps, *self._norm_sums(), first_bad]).tolist()
        self._start()
        return tuple(sums)

    def _loss_sums(self) -> list[torch.Tensor]:
        """The finite losses' sum (added in step order), their count, the first non-finite step."""
        if not self.losses:
            return [self._zero(), self._zero(), self._zero() + math.inf]
        value = torch.stack(self.losses).double()
        finite = torch.isfinite(value)
        steps = torch.tensor(self.steps, dtype=torch.float64, device=self.device)
        first_bad = torch.where(finite, math.inf, steps).min()
        return [torch.where(finite, value, 0.0).cumsum(0)[-1], finite.double().sum(), first_bad]

    def _norm_sums(self) -> list[torch.Tensor]:
        """The finite norms' sum (in step order), the steps clipped, the number of finite norms."""
        if not self.norms:
            return [self._zero()] * 3
        norm = torch.stack(self.norms).double()
        finite = torch.isfinite(norm)
        clipped = finite & (norm > self.max_norm)
        return [torch.where(finite, norm, 0.0).cumsum(0)[-1], clipped.double().sum(), finite.double().sum()]

    def _zero(self) -> torch.Tensor:
        return torch.zeros((), dtype=torch.float64, device=self.device)


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
