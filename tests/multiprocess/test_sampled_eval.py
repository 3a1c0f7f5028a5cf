"""Periodic evals on a fixed validation sample, full evals at the cadence and the end, and the
sample's bias check, on world sizes 1 and 3 (gloo), against numpy over the saved predictions."""

from __future__ import annotations

import json
import math

import pyarrow.parquet as pq
import pytest

from service.distributed.topology import Topology
from service.planning.trial import TrialPlan
from service.study import spec
from service.trainer.loop import train
from tests.helpers.gloo import run_gloo

SAMPLE, EVERY, FULL_EVERY, MAX_STEPS = 90, 10, 20, 40


class NullReporter:
    def report(self, metrics, checkpoint_dir):
        pass

    def restore(self):
        return None


def make_plan(digits_dir, storage, world: int) -> TrialPlan:
    study = spec.load_dict(
        {
            "name": "sampled",
            "workload": "digits",
            "data": {s: f"{digits_dir}/{s}" for s in ("train", "validation")},
            "storage": storage,
            "scaling": {"num_hosts": 1, "workers_per_host": world},
            "training": {
                "max_train_steps": MAX_STEPS,
                "batch_size": 30,
                "eval_batch_size": 60,
                "eval_every_steps": EVERY,
                "metric": "validation/loss",
                "seed": 5,
                "validation_sample_size": SAMPLE,
                "full_eval_every_steps": FULL_EVERY,
            },
            "search": {"learning_rate": {"role": "fixed", "value": 0.1}},
            "rounds": [{"name": "r1", "num_trials": 1}],
        }
    )
    return TrialPlan(study, "r1-0", "r1", {"learning_rate": 0.1, "momentum": 0.9, "width": 4})


def train_rank(rank, world, digits_dir, storage):
    topo = Topology(world_rank=rank, world_size=world, local_rank=rank, workers_per_host=world)
    train(make_plan(digits_dir, storage, world), topo, NullReporter())
    return rank


@pytest.mark.parametrize("world", [1, 3])
def test_sampled_and_full_evals(digits_dir, tmp_path, world):
    storage = tmp_path / "storage"
    run_gloo(train_rank, world, tmp_path, str(digits_dir), str(storage))
    plan = make_plan(digits_dir, str(storage), world)
    with open(plan.metrics_uri) as f:
        log = [json.loads(line) for line in f]
    val_ids = pq.read_table(str(digits_dir / "validation")).column("example_id").to_numpy()

    sample_ids = None
    for row in log:
        step = row["step"]
        sampled = pq.read_table(plan.predictions_uri("validation-sample", step)).to_pandas()
        ids = sorted(sampled["example_id"])
        assert len(ids) == SAMPLE and set(ids) <= set(val_ids)
        sample_ids = sample_ids or ids
        assert ids == sample_ids  # the same sample at every eval
        assert row["validation/count"] == SAMPLE
        assert row["validation/loss"] == pytest.approx(sampled["metric/loss"].mean(), rel=1e-9)
        assert row["validation/error"] == pytest.approx((sampled["prediction"] != sampled["label"]).mean())

        full_eval = step % FULL_EVERY == 0 or step == MAX_STEPS
        assert ("validation_full/loss" in row) == full_eval
        if not full_eval:
            continue
        full = pq.read_table(plan.predictions_uri("validation", step)).to_pandas()
        assert sorted(full["example_id"]) == sorted(val_ids)
        assert row["validation_full/count"] == len(val_ids)
        assert row["validation_full/loss"] == pytest.approx(full["metric/loss"].mean(), rel=1e-9)
        # The gap and its noise, computed here from the full predictions alone.
        values = full.set_index("example_id")["metric/loss"]
        sample_values = values.loc[sample_ids].to_numpy()
        n, big_n = len(sample_values), len(values)
        gap = sample_values.mean() - values.mean()
        se = math.sqrt((1 - n / big_n) * values.var(ddof=1) / n)
        assert row["validation_full/sample_gap"] == pytest.approx(gap, abs=1e-9)
        assert row["validation_full/sample_biased"] == (abs(gap) > 1.96 * se)
        # The sampled metric of the same step is the full eval's mean over the sample rows.
        assert row["validation/loss"] == pytest.approx(sample_values.mean(), rel=1e-9)
    assert sorted(r["step"] for r in log) == list(range(EVERY, MAX_STEPS + 1, EVERY))


def test_eval_batch_smaller_than_train_batch_needs_a_reason():
    base = {"max_train_steps": 10, "batch_size": 64, "eval_every_steps": 5, "eval_batch_size": 32}
    with pytest.raises(spec.SpecError, match=r"^training.eval_batch_size: .*eval_batch_size_reason"):
        spec.load_dict(
            {
                "name": "x",
                "workload": "digits",
                "data": {"train": "a", "validation": "b"},
                "training": base,
                "search": {"learning_rate": {"role": "fixed", "value": 0.1}},
                "rounds": [{"name": "r", "num_trials": 1}],
            }
        )
    ok = spec.load_dict(
        {
            "name": "x",
            "workload": "digits",
            "data": {"train": "a", "validation": "b"},
            "training": {**base, "eval_batch_size_reason": "activation memory"},
            "search": {"learning_rate": {"role": "fixed", "value": 0.1}},
            "rounds": [{"name": "r", "num_trials": 1}],
        }
    )
    assert ok.training.resolved_eval_batch_size == 32
