"""The step loop's interval tally (service/trainer/tally.py): a step only keeps its loss and norm,
the sums are done at the eval point, and they are the ones a plain Python loop computes."""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from service.trainer.tally import StepTally


class CountOps(TorchDispatchMode):
    """Counts the aten operators dispatched while it is active."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_step_does_no_tensor_arithmetic():
    tally = StepTally(torch.device("cpu"))
    loss, norm = torch.tensor(0.25), torch.tensor(3.0)
    with CountOps() as counted:
        for step in range(1, 11):
            tally.add(loss, step)
            tally.add_grad_norm(norm, 1.0)
    assert all("detach" in op for op in counted.ops), counted.ops  # one detach per tensor kept


def test_take_is_the_plain_loops_sums_and_starts_the_next_interval():
    losses = [0.5, 1e-9, float("nan"), 2.25, float("inf"), 1e9, 0.1, float("nan"), 3.0]
    norms = [0.5, 2.0, float("inf"), 1.0, 7.5, float("nan"), 0.99, 1.01, 4.0]
    first_step, max_norm = 41, 1.0
    tally = StepTally(torch.device("cpu"))
    for i, (loss, norm) in enumerate(zip(losses, norms, strict=True)):
        tally.add(torch.tensor(loss, dtype=torch.float32), first_step + i)
        tally.add_grad_norm(torch.tensor(norm, dtype=torch.float32), max_norm)
    # By hand: float64 sums in step order of the float32 values, finite ones only.
    f32 = [float(torch.tensor(v, dtype=torch.float32)) for v in losses]
    n32 = [float(torch.tensor(v, dtype=torch.float32)) for v in norms]
    loss_sum, norm_sum = 0.0, 0.0
    for v in f32:
        loss_sum += v if math.isfinite(v) else 0.0
    for v in n32:
        norm_sum += v if math.isfinite(v) else 0.0
    want = (
        loss_sum,
        sum(math.isfinite(v) for v in f32),
        norm_sum,
        sum(math.isfinite(v) and v > max_norm for v in n32),
        sum(math.isfinite(v) for v in n32),
        float(first_step + 2),  # the first NaN
    )
    assert tally.take() == want
    assert tally.take() == (0.0, 0.0, 0.0, 0.0, 0.0, math.inf)  # a new interval, empty
    tally.add(torch.tensor(1.5), 60)
    assert tally.take() == (1.5, 1.0, 0.0, 0.0, 0.0, math.inf)
