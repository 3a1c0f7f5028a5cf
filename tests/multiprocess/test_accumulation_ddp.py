"""Gradient accumulation over 2 gloo ranks (DDP): a run with microbatches equals the run without
at every eval point, and DDP all-reduces once per step: between a step's microbatches each
rank's gradients are still its own (`no_sync`)."""

from __future__ import annotations

import pathlib

import pytest
import torch

from service.distributed import checkpoint
from service.distributed.topology import Topology
from service.trainer.loop import train
from tests.helpers import mlp_workload
from tests.helpers.gloo import run_gloo
from tests.helpers.trainer_runs import Reporter, make_plan

STEPS, MICRO = 8, 4  # per-worker batch 16: 4 microbatches


def accumulation_rank(rank: int, world: int, digits_dir: str, tmp: str) -> dict:
    """Both runs on this rank: whole per-worker batches, then microbatches of MICRO rows."""
    topo = Topology(world_rank=rank, world_size=world, local_rank=rank, workers_per_host=world)
    out = {}
    for name, micro in (("whole", None), ("micro", MICRO)):
        plan = make_plan(
            pathlib.Path(digits_dir),
            pathlib.Path(tmp) / "storage",
            trial_name=f"r1-{name}",
            workload="tests.helpers.mlp_workload:MLPDigits",
            max_train_steps=STEPS,
            eval_every_steps=4,
            batch_size=32,
            schedule={"kind": "constant"},
            microbatch_size=micro,
        )
        mlp_workload.SEEN.clear()
        reporter = Reporter(pathlib.Path(tmp) / f"ckpt-{name}-{rank}")
        train(plan, topo, reporter)
        out[name] = {"metrics": reporter.metrics, "seen": list(mlp_workload.SEEN)}
        if rank == 0:
            out[name]["weights"] = checkpoint.load(reporter.reports[-1][1]).model
    return out


def test_microbatches_over_two_ranks_equal_whole_batches_with_one_all_reduce_per_step(digits_dir, tmp_path):
    r0, r1 = run_gloo(accumulation_rank, 2, tmp_path, str(digits_dir), str(tmp_path))
    whole, micro = r0["whole"], r0["micro"]
    for a, b in zip(whole["metrics"], micro["metrics"], strict=True):
        assert a["step"] == b["step"]
        for key in ("train/loss", "validation/loss", "validation/error"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    for name, value in whole["weights"].items():
        torch.testing.assert_close(micro["weights"][name], value, rtol=1e-5, atol=1e-6)

    # Each forward pass after a step's first microbatch sees the gradients accumulated so far:
    # different on the two ranks (not yet all-reduced); whole batches see none.
    assert [rows for rows, _ in micro["seen"]] == [MICRO] * 4 * STEPS
    for step in range(STEPS):
        for i in range(1, 4):
            (_, g0), (_, g1) = r0["micro"]["seen"][4 * step + i], r1["micro"]["seen"][4 * step + i]
            assert g0 is not None and g0 != pytest.approx(g1, rel=1e-6), (step, i)
    assert all(g is None for _, g in whole["seen"])
