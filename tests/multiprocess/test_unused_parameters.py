"""`scaling.find_unused_parameters` over 2 gloo ranks (DDP): a model with a head that no step
uses trains with it, the unused head's weights staying as initialised; without it the trial
fails at its first step, on every rank, in one line naming the option and the parameters (DDP's
own error came a step later, after an update with gradients never all-reduced)."""

from __future__ import annotations

import dataclasses
import math
import pathlib

import torch

from service.distributed import checkpoint
from service.distributed.topology import Topology, init_seed
from service.orchestration.ray_private import final_error_of
from service.planning.trial import TrialPlan
from service.trainer.loop import train
from tests.helpers.gloo import run_gloo
from tests.helpers.linear_workload import SpareHeadDigits
from tests.helpers.trainer_runs import Reporter, make_plan

STEPS = 6


def unused_rank(rank: int, world: int, digits_dir: str, tmp: str) -> dict:
    topo = Topology(world_rank=rank, world_size=world, local_rank=rank, workers_per_host=world)
    out = {}
    for find in (True, False):
        plan = make_plan(
            pathlib.Path(digits_dir),
            pathlib.Path(tmp) / "storage",
            trial_name=f"r1-{find}",
            workload="tests.helpers.linear_workload:SpareHeadDigits",
            max_train_steps=STEPS,
            eval_every_steps=3,
            schedule={"kind": "constant"},
        )
        scaling = dataclasses.replace(plan.study.scaling, workers_per_host=world, find_unused_parameters=find)
        plan = TrialPlan(
            dataclasses.replace(plan.study, scaling=scaling), plan.trial_name, plan.round_name, plan.hparams
        )
        reporter = Reporter(pathlib.Path(tmp) / f"ckpt-{find}-{rank}")
        try:
            train(plan, topo, reporter)
            saved = reporter.reports[-1][1]  # rank 0 saves the checkpoints
            out[find] = {"metrics": reporter.metrics, "weights": saved and checkpoint.load(saved).model}
        except Exception as e:
            out[find] = {"error": str(e), "final": final_error_of(e, "") is e}
        torch.manual_seed(init_seed(plan.trial_seed))  # the trial's initial weights, as a plain model
        out["initial"] = SpareHeadDigits().build_model({}).state_dict()
    return out


def test_a_model_with_an_unused_head_trains_only_with_find_unused_parameters(digits_dir, tmp_path):
    by_rank = run_gloo(unused_rank, 2, tmp_path, str(digits_dir), str(tmp_path))
    for r in by_rank:
        found = r[True]
        assert [m["step"] for m in found["metrics"]] == [3, 6]
        assert all(math.isfinite(m["train/loss"]) for m in found["metrics"])
        # at the first step, in one line naming the field and the unused parameters, not retried
        assert r[False]["error"] == (
            "scaling.find_unused_parameters: a training step left parameters of the model without a "
            "gradient (spare.weight, spare.bias); set it to true for a model whose steps do not use "
            "every parameter"
        )
        assert r[False]["final"]
    weights, initial = by_rank[0][True]["weights"], by_rank[0]["initial"]
    assert set(weights) == {"used.1.weight", "used.1.bias", "spare.weight", "spare.bias"}
    for name in ("spare.weight", "spare.bias"):  # never a gradient: as initialised
        torch.testing.assert_close(weights[name], initial[name], rtol=0, atol=0)
    assert not torch.equal(weights["used.1.weight"], initial["used.1.weight"])  # it trained
