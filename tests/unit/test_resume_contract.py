"""What resume restores, each part checked: resuming from an exact checkpoint ends bitwise equal to
the uninterrupted run, and changing any one part of that checkpoint (weights, optimizer state,
RNG state, step = schedule and data position) changes the result, so each part is really used."""

from __future__ import annotations

import copy

import pytest
import torch

from service.distributed import checkpoint
from service.distributed.topology import Topology
from service.trainer.loop import train
from tests.helpers.trainer_runs import Interrupted, Reporter, make_plan, without_timing

WORKLOAD = "tests.helpers.rng_workloads:DropoutDigits"  # dropout: training draws from the RNG


def perturb_model(s):
    key = next(k for k, v in s.model.items() if v.is_floating_point())
    s.model[key] = s.model[key] + 1e-3


def perturb_optimizer(s):
    for state in s.optimizer["state"].values():
        state["momentum_buffer"] = torch.zeros_like(state["momentum_buffer"])


def perturb_rng(s):
    s.rng_states = [torch.Generator().manual_seed(4321).get_state()]


def perturb_step(s):  # the step is the schedule position and the data position
    s.step -= 1


PARTS = {"model": perturb_model, "optimizer": perturb_optimizer, "rng": perturb_rng, "step": perturb_step}


@pytest.fixture(scope="module")
def runs(digits_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("contract")
    reference = Reporter(tmp / "ref")
    train(make_plan(digits_dir, tmp / "s-ref", workload=WORKLOAD), Topology(), reference)
    first = Reporter(tmp / "first", stop_after=1)
    with pytest.raises(Interrupted):
        train(make_plan(digits_dir, tmp / "s-first", workload=WORKLOAD), Topology(), first)
    return tmp, reference, checkpoint.load(first.reports[0][1])


def resume_from(state, digits_dir, store):
    torch.manual_seed(777)  # a fresh process's global RNG
    reporter = Reporter(store, restore_state=state)
    train(make_plan(digits_dir, store / "storage", workload=WORKLOAD), Topology(), reporter)
    return reporter, checkpoint.load(reporter.reports[-1][1])


def same_weights(a, b) -> bool:
    return all(torch.equal(a.model[k], b.model[k]) for k in b.model)


def test_an_exact_checkpoint_resumes_bitwise(runs, digits_dir, tmp_path):
    _, reference, saved = runs
    resumed, final = resume_from(copy.deepcopy(saved), digits_dir, tmp_path)
    assert [without_timing(m) for m in resumed.metrics] == [without_timing(m) for m in reference.metrics[1:]]
    assert same_weights(final, checkpoint.load(reference.reports[-1][1]))


@pytest.mark.parametrize("part", sorted(PARTS))
def test_each_restored_part_matters(runs, digits_dir, tmp_path, part):
    _, reference, saved = runs
    changed = copy.deepcopy(saved)
    PARTS[part](changed)
    _, final = resume_from(changed, digits_dir, tmp_path)
    assert not same_weights(final, checkpoint.load(reference.reports[-1][1]))
