"""A parameter that a step's forward pass does not reach, over 2 gloo ranks with DDP
(`find_unused_parameters=True`, as the service wraps CPU models): with the gradients kept as the
step loop keeps them (`trainer.grad_norm`: one buffer on CPU) the optimizer updates exactly the
parameters it updates after `zero_grad(set_to_none=True)`, whether a head is unused on every rank
(its gradient stays None) or on one rank only (the all-reduced gradient reaches it)."""

from __future__ import annotations

import torch
from torch import nn

from service.trainer.grad_norm import GradNorm
from tests.helpers.gloo import run_gloo
from tests.helpers.two_branches import TwoBranches

STEPS = 7


def head(step: int, rank: int) -> str:
    """Rank 0 uses head b on steps 2, 5; rank 1 on steps 1, 4: on steps 0, 3, 6 no rank does."""
    return "b" if (step + rank) % 3 == 2 else "a"


def train_rank(rank: int, world: int) -> dict:
    out = {}
    for name in ("service", "plain"):
        torch.manual_seed(0)
        model = TwoBranches()
        ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)  # moves a zero gradient
        grads = GradNorm(model)
        gen = torch.Generator().manual_seed(rank)
        had = []
        for step in range(STEPS):
            if name == "service":
                grads.zero(opt)
            else:
                opt.zero_grad(set_to_none=True)
            ddp(torch.randn(5, 6, generator=gen), head(step, rank)).square().mean().backward()
            if name == "service":
                grads.settle()
            had.append([p.grad is not None for p in model.parameters()])
            opt.step()
        out[name] = {"had": had, "weights": {k: v.clone() for k, v in model.state_dict().items()}}
    return out


def test_unused_parameters_over_two_ranks_update_as_after_set_to_none(tmp_path):
    ranks = run_gloo(train_rank, 2, tmp_path)
    for r in ranks:
        assert r["service"]["had"] == r["plain"]["had"]
        for k, v in r["plain"]["weights"].items():
            assert torch.equal(r["service"]["weights"][k], v), k
    b_weight = [h[4] for h in ranks[0]["plain"]["had"]]
    assert b_weight == [False, True, True, False, True, True, False]  # None only where no rank used b
    assert GradNorm(TwoBranches()).flat is not None  # the buffer is what ran
