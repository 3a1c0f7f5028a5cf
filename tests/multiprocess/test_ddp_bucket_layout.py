"""The gradient buckets DDP all-reduces on CPU (`setup.wrap_ddp`) on 3 gloo ranks: the first
steps of a DDP built again on the same model (a restart) all-reduce the same buckets, each with
its parameters in the same order, as the same steps of an uninterrupted one. DDP's own default
rebuilds its buckets after its first step in the order the gradients became ready, so a restart's
first step would sum 3 ranks' gradients in another order (test_resume_three_ranks.py)."""

from __future__ import annotations

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from service import workloads
from service.trainer.setup import wrap_ddp
from tests.helpers.gloo import run_gloo

STEPS, RESTART = 4, 2


def layouts(model: torch.nn.Module, x: torch.Tensor, steps: int) -> list[list[tuple[int, ...]]]:
    """Per step: every all-reduced bucket as its parameters' indices, in the bucket's order
    (recorded by a comm hook that then all-reduces as DDP would)."""
    ddp = wrap_ddp(model, "cpu")
    index = {id(p): i for i, p in enumerate(model.parameters())}
    seen: list[list[tuple[int, ...]]] = []

    def record(state, bucket):
        seen[-1].append(tuple(index[id(p)] for p in bucket.parameters()))
        return default_hooks.allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, record)
    for _ in range(steps):
        seen.append([])
        ddp(x).float().sum().backward()
    return seen


def layout_rank(rank: int, world: int) -> dict:
    out = {}
    for name, x in (
        ("images", torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8)),
        ("digits", torch.rand(4, 1, 8, 8)),
    ):
        torch.manual_seed(0)
        model = workloads.get(name).build_model({})
        out[name] = {
            "uninterrupted": layouts(model, x, STEPS),
            "restarted": layouts(model, x, STEPS - RESTART),
        }
    return out


def test_restart_all_reduces_the_uninterrupted_runs_buckets(tmp_path):
    by_rank = run_gloo(layout_rank, 3, tmp_path)
    for name, runs in by_rank[0].items():
        full, again = runs["uninterrupted"], runs["restarted"]
        for step, buckets in enumerate(again, start=RESTART):
            # Buckets are all-reduced one by one: only their contents and order within count.
            assert sorted(buckets) == sorted(full[step]), (name, step)
        all_params = sorted(i for bucket in full[0] for i in bucket)
        assert all_params == list(range(len(all_params))), name  # every parameter, once
        assert all(r[name] == runs for r in by_rank[1:]), name  # the same on every rank
