"""FSDP trials over gloo ranks (no Ray), against the same trial under DDP: every evaluation's
metrics (fp32: to float rounding; bf16: within a stated tolerance), with gradient clipping by
the global norm over the shards, microbatch accumulation, Nesterov and AdamW, BatchNorm
statistics synced and ghost batch norm, HSDP; and a trial cut after its second evaluation
resumes from its sharded checkpoint bitwise equal to the uninterrupted one."""

from __future__ import annotations

import pathlib

import pytest

from service.data import text
from tests.helpers.fsdp_runs import LM_HPARAMS, SEQ_LEN, digits_plan, lm_plan, train_rank, trial_plan
from tests.helpers.gloo import run_gloo
from tests.helpers.trainer_runs import without_timing

COMPARED = ("train/loss", "train/grad_norm", "train/clipped_fraction", "validation/loss")
FP32_REL = 1e-5
"""FSDP reduce-scatters gradients where DDP all-reduces them: the same sums in another order."""
BF16_REL = 0.02
"""bf16 under FSDP (parameters gathered in bf16) against fp32 under DDP: a loss within 2%."""


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    text.write_text(str(root), 20_000, SEQ_LEN)
    return root


@pytest.fixture(scope="module")
def reference(text_dir, tmp_path_factory):
    """The plain lm trial (AdamW, fp32) under each strategy, run once for the module: the
    fsdp one's plan and rows, and the ddp one's rows."""
    root = tmp_path_factory.mktemp("reference")
    plans = {s: lm_plan(text_dir, root / s, s) for s in ("ddp", "fsdp")}
    rows = {s: run(plan, root / s) for s, plan in plans.items()}
    return plans["fsdp"], rows["fsdp"], rows["ddp"]


def run(plan, tmp: pathlib.Path, world: int = 2, stop_after=None, async_save=False) -> list[dict]:
    tmp.mkdir(parents=True, exist_ok=True)
    return run_gloo(train_rank, world, tmp, plan, stop_after, async_save)[0]["metrics"]


def assert_close_rows(rows, reference, rel, keys=COMPARED):
    assert [r["step"] for r in rows] == [r["step"] for r in reference]
    for row, ref in zip(rows, reference, strict=True):
        for key in keys:
            assert row[key] == pytest.approx(ref[key], rel=rel), (row["step"], key)


def test_an_lm_trial_under_fsdp_equals_ddp_at_every_evaluation(reference):
    _, fsdp, ddp = reference
    assert_close_rows(fsdp, ddp, FP32_REL)


def test_clipping_microbatches_nesterov_and_parameter_groups_under_fsdp_equal_ddp(text_dir, tmp_path):
    """Clipping by the global norm bites on some steps, not all (the norm is the whole model's);
    the workload's parameter groups (decay on matrices only) group the shards as the whole
    parameters."""
    workload = "tests.helpers.fsdp_runs:DecayGroupsLM"
    options = {"microbatch_size": 2, "optimizer": "nesterov"}
    hparams = {**LM_HPARAMS, "grad_clip_norm": 1.6, "momentum": 0.9, "weight_decay": 0.1}
    rows = {}
    for s in ("ddp", "fsdp"):
        plan = trial_plan(workload, text_dir, tmp_path / s, s, 2, hparams, None, **options)
        rows[s] = run(plan, tmp_path / s)
    assert_close_rows(rows["fsdp"], rows["ddp"], FP32_REL)
    fractions = {r["train/clipped_fraction"] for r in rows["fsdp"]}
    assert fractions - {0.0} and fractions - {1.0}, fractions


def test_microbatches_under_fsdp_reduce_the_gradients_once_per_step(text_dir, tmp_path, reference):
    """2 microbatches of 2 rows per rank: at the second one's forward no shard holds a gradient
    yet (nothing reduce-scattered), and the trial equals the one without microbatches."""
    plan = trial_plan_of(
        text_dir, tmp_path / "micro", "tests.helpers.fsdp_runs:GradSeenLM", microbatch_size=2
    )
    (tmp_path / "micro").mkdir()
    result = run_gloo(train_rank, 2, tmp_path / "micro", plan)[0]
    first_steps = result["seen"][:8]  # the 2 forwards of each of steps 1-4 (then the evaluation's)
    assert first_steps == [False, False] * 4, first_steps
    assert_close_rows(result["metrics"], reference[1], FP32_REL)


def trial_plan_of(text_dir, storage, workload, **training):
    return trial_plan(workload, text_dir, storage, "fsdp", 2, LM_HPARAMS, None, **training)


def test_bf16_under_fsdp_is_within_the_stated_tolerance_of_fp32(text_dir, tmp_path, reference):
    fp32 = reference[2]
    bf16 = run(lm_plan(text_dir, tmp_path / "bf16", precision="bf16"), tmp_path / "bf16")
    assert_close_rows(bf16, fp32, BF16_REL, keys=("train/loss", "validation/loss"))
    assert [r["validation/loss"] for r in bf16] != [r["validation/loss"] for r in fp32]  # bf16 did run


@pytest.mark.parametrize("ghost", [False, True], ids=["batchnorm", "ghost-batchnorm"])
def test_a_batchnorm_model_under_fsdp_equals_ddp(digits_dir, tmp_path, ghost):
    """The running statistics (buffers: not sharded) are averaged over the ranks before each
    evaluation and checkpoint, under FSDP as under DDP; ghost batch norm likewise."""
    options = {"ghost_batch_norm": True, "virtual_batch_size": 8} if ghost else {}
    rows = {
        s: run(digits_plan(digits_dir, tmp_path / s, s, **options), tmp_path / s) for s in ("ddp", "fsdp")
    }
    assert_close_rows(rows["fsdp"], rows["ddp"], FP32_REL, keys=(*COMPARED, "validation/error"))


def test_hsdp_over_two_replicas_of_two_shards_equals_ddp_on_four_ranks(text_dir, tmp_path):
    ddp = run(
        lm_plan(text_dir, tmp_path / "ddp", "ddp", workers=2, scaling={"num_hosts": 2}), tmp_path / "ddp", 4
    )
    hsdp_plan = lm_plan(
        text_dir, tmp_path / "hsdp", workers=2, scaling={"num_hosts": 2, "shard_group_size": 2}
    )
    hsdp = run(hsdp_plan, tmp_path / "hsdp", 4)
    assert_close_rows(hsdp, ddp, FP32_REL)


def test_a_cut_fsdp_trial_resumes_from_its_sharded_checkpoint_bitwise(text_dir, tmp_path, reference):
    """Cut after the step-8 evaluation (its checkpoint saved in the background), then rerun:
    every later evaluation and the last checkpoint's shards are those of the uninterrupted run."""
    full_plan, full, _ = reference
    cut_plan = lm_plan(text_dir, tmp_path / "cut")
    before = run(cut_plan, tmp_path / "cut" / "first", stop_after=2, async_save=True)
    after = run(cut_plan, tmp_path / "cut" / "again", async_save=True)
    assert [r["step"] for r in before] == [4, 8] and [r["step"] for r in after] == [12]
    assert [without_timing(r) for r in before + after] == [without_timing(r) for r in full]

    def shards(plan) -> dict[str, bytes]:
        folder = pathlib.Path(plan.trial_uri) / "checkpoint_00000012" / "model"
        return {p.name: p.read_bytes() for p in folder.glob("__*.distcp")}

    assert len(shards(full_plan)) == 2 and shards(cut_plan) == shards(full_plan)


def test_an_fsdp_trial_that_diverges_stops_on_every_rank_at_the_same_step(text_dir, tmp_path):
    """A learning rate that overflows: every rank reports DIVERGED at the first eval point after
    the first non-finite loss, at the step the DDP trial diverges at, and nothing is checkpointed
    after it."""
    hparams = {**lm_plan(text_dir, tmp_path).hparams, "learning_rate": 1e30}
    rows = {}
    for strategy in ("ddp", "fsdp"):
        plan = lm_plan(
            text_dir, tmp_path / strategy, strategy, hparams=hparams, schedule={"kind": "constant"}
        )
        rows[strategy] = run(plan, tmp_path / strategy)
    last = rows["fsdp"][-1]
    assert last["status"] == "diverged" and last["step"] < 12
    assert [(r["step"], r["status"]) for r in rows["fsdp"]] == [(r["step"], r["status"]) for r in rows["ddp"]]
    assert last["diverged_at_step"] == rows["ddp"][-1]["diverged_at_step"]
    kept = sorted(p.name for p in pathlib.Path(plan.trial_uri).glob("checkpoint_*"))
    assert all(int(name.split("_")[1]) < last["step"] for name in kept), kept
