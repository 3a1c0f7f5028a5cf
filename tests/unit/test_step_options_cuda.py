"""The step options on a CUDA device (skipped without one: run on a GPU machine, not in CI):
torch.compile with its default backend (inductor) trains the same model under the same
checkpoint keys; bf16 and fp16 train the same model as whole fp32 batches to half-precision
tolerance, fp16 saving its scaler; microbatches equal whole batches."""

from __future__ import annotations

import pytest
import torch

from service.distributed import checkpoint
from service.distributed.topology import Topology
from service.trainer.loop import train
from tests.helpers.trainer_runs import HPARAMS, Reporter, make_plan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MLP = "tests.helpers.mlp_workload:MLPDigits"


def cuda_run(digits_dir, tmp_path, name, **training) -> tuple[checkpoint.TrialState, list[dict]]:
    plan = make_plan(
        digits_dir,
        tmp_path / name,
        hparams={**HPARAMS, "width": 16},
        max_train_steps=8,
        eval_every_steps=4,
        batch_size=32,
        schedule={"kind": "constant"},
        **training,
    )
    reporter = Reporter(tmp_path / f"{name}-ckpt")
    train(plan, Topology(), reporter, torch.device("cuda"))
    return checkpoint.load(reporter.reports[-1][1]), reporter.metrics


def assert_states_close(a: dict, b: dict, **tol) -> None:
    assert list(a) == list(b)
    for name, value in a.items():
        torch.testing.assert_close(b[name].double(), value.double(), **tol)


def test_compile_with_inductor_trains_the_same_model_under_the_same_keys(digits_dir, tmp_path):
    plain, _ = cuda_run(digits_dir, tmp_path, "plain")
    compiled, metrics = cuda_run(digits_dir, tmp_path, "compiled", compile=True)
    assert_states_close(plain.model, compiled.model, rtol=1e-4, atol=1e-5)
    assert metrics[-1]["status"] == "finished"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_on_cuda_stays_near_fp32(digits_dir, tmp_path, precision):
    fp32, fm = cuda_run(digits_dir, tmp_path, "fp32", workload=MLP)
    half, hm = cuda_run(digits_dir, tmp_path, precision, workload=MLP, precision=precision)
    assert_states_close(fp32.model, half.model, rtol=0.05, atol=0.02)
    assert any(not torch.equal(fp32.model[k], half.model[k]) for k in fp32.model)  # it ran in half
    assert (half.scaler != {}) == (precision == "fp16")
    for a, b in zip(fm, hm, strict=True):
        assert b["validation/loss"] == pytest.approx(a["validation/loss"], rel=0.02)


def test_microbatches_on_cuda_equal_whole_batches(digits_dir, tmp_path):
    whole, wm = cuda_run(digits_dir, tmp_path, "whole", workload=MLP)
    micro, mm = cuda_run(digits_dir, tmp_path, "micro", workload=MLP, microbatch_size=8)
    assert_states_close(whole.model, micro.model, rtol=1e-4, atol=1e-5)
    for a, b in zip(wm, mm, strict=True):
        assert b["validation/loss"] == pytest.approx(a["validation/loss"], rel=1e-5)
