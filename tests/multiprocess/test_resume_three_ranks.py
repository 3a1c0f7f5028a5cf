"""Resume on 3 ranks (gloo, no Ray): a run restored from its step-10 checkpoint ends bitwise
equal to the uninterrupted run. With 2 ranks the gradient all-reduce adds a + b, the same in
any order; with 3 the order of the float sums depends on where each gradient sits in DDP's
bucket, which must not change between the first step after a restart and the same step of an
uninterrupted run."""

from __future__ import annotations

import pathlib

import torch

from service.distributed import checkpoint
from service.distributed.topology import Topology
from tests.helpers.gloo import run_gloo
from tests.helpers.studies import same_nested
from tests.helpers.trainer_runs import Reporter, make_plan, without_timing

WORLD = 3


def train_rank(rank: int, world: int, digits_dir: str, storage: str, store: str, restore_from: str | None):
    from service.trainer.loop import train

    plan = make_plan(
        pathlib.Path(digits_dir),
        storage,
        max_train_steps=20,
        eval_every_steps=10,
        batch_size=30,
        eval_batch_size=60,
    )
    topo = Topology(world_rank=rank, world_size=world, host_rank=rank, num_hosts=world)
    state = checkpoint.load(restore_from) if restore_from else None
    reporter = Reporter(pathlib.Path(store), restore_state=state)
    train(plan, topo, reporter)
    return [d for _, d in reporter.reports if d]


def test_three_ranks_resume_bitwise(digits_dir, tmp_path):
    (full, resumed) = (tmp_path / "full", tmp_path / "resumed")
    full.mkdir(), resumed.mkdir()
    uninterrupted = run_gloo(train_rank, WORLD, full, str(digits_dir), str(full / "s"), str(full), None)[0]
    at_10, at_20 = (checkpoint.load(d) for d in uninterrupted)
    assert (at_10.step, at_20.step) == (10, 20)
    again = run_gloo(
        train_rank, WORLD, resumed, str(digits_dir), str(resumed / "s"), str(resumed), uninterrupted[0]
    )
    final = checkpoint.load(again[0][-1])
    assert final.step == 20
    for part in ("model", "optimizer", "rng_states"):
        assert same_nested(getattr(final, part), getattr(at_20, part)), part
    assert [without_timing(r)["train/loss"] for r in final.history] == [
        without_timing(r)["train/loss"] for r in at_20.history
    ]
    assert torch.equal(final.model[next(iter(final.model))], at_20.model[next(iter(at_20.model))])
