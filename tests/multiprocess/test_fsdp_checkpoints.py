"""What FSDP changes on each rank and on disk (gloo, no Ray): each rank holds about 1/N of the
parameters, gradients and optimizer state (counted from the local shards, against DDP's
whole copies); a sharded checkpoint evaluated offline on 1 rank (read whole) and on 4 (resharded)
gives the trial's own last evaluation; the exported file loads into the plain model (torch and
safetensors) and reproduces it; a checkpoint with a shard missing, truncated or damaged is
refused naming the file, by every rank alike, and a trial resumes from the newest whole one."""

from __future__ import annotations

import io
import json
import os
import pathlib
import shutil
from contextlib import redirect_stderr

import pyarrow.parquet as pq
import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

from service import workloads
from service.cli import main
from service.core.errors import CheckpointError
from service.data import text
from service.data.files import list_files
from service.data.loader import eval_batches
from service.data.sharding import row_ranges
from service.distributed import sharded, sharding
from service.distributed.topology import Topology
from service.evaluation.offline import evaluate_checkpoint, predictions_uri
from service.evaluation.run import evaluate
from service.study import spec
from tests.helpers.fsdp_runs import LM_HPARAMS, SEQ_LEN, lm_plan, train_rank
from tests.helpers.gloo import run_gloo
from tests.helpers.studies import same_nested
from tests.helpers.trainer_runs import without_timing


@pytest.fixture(scope="module")
def trial(tmp_path_factory):
    """A 2-rank FSDP lm trial, its study file stored as `playbook run` stores it."""
    root = tmp_path_factory.mktemp("fsdp-trial")
    text.write_text(str(root / "text"), 20_000, SEQ_LEN)
    plan = lm_plan(root / "text", root / "storage")
    os.makedirs(plan.study.study_uri, exist_ok=True)
    pathlib.Path(plan.study.layout.study_file).write_text(spec.dump_yaml(plan.study))
    rows = run_gloo(train_rank, 2, root, plan)[0]["metrics"]
    return plan, rows, pathlib.Path(plan.trial_uri) / "checkpoint_00000012"


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def one_step_bytes(rank: int, world: int, plan) -> dict:
    """This rank's bytes of parameters, gradients and optimizer state after one step (local
    shards under fsdp), each parameter's local element count, and whether the state dicts a
    checkpoint saves are torch's."""
    from service.trainer.profiling import StepProfiler
    from service.trainer.setup import Progress, set_up
    from service.trainer.step import train_step

    topo = Topology(world_rank=rank, world_size=world, local_rank=rank, workers_per_host=world)
    ctx = set_up(plan, topo, torch.device("cpu"))
    train_step(ctx, Progress(0, []), ctx.stream.iterate(0), StepProfiler("", 0, 1))

    params = list(ctx.model.parameters())
    state = [local(v) for s in ctx.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {
        "as_torch_makes_them": same_as_torch(ctx.model, ctx.optimizer),
        "params": sum(local(p).nbytes for p in params),
        "grads": sum(local(p.grad).nbytes for p in params if p.grad is not None),
        "optimizer": sum(t.nbytes for t in state if t.ndim),
        "numels": {n: local(p).numel() for n, p in ctx.model.named_parameters()},
    }


def same_as_torch(model, optimizer) -> bool:
    """The checkpointed state dicts are torch's `get_state_dict` (or, for DDP, torch's own)."""
    ours = sharding.state_dicts(model, optimizer)
    theirs = get_state_dict(model, optimizer) if sharding.is_sharded(model) else (model.state_dict(), {})
    if not sharding.is_sharded(model):
        return same_nested(ours[0], theirs[0])
    locals_ = [
        {k: local(v) if torch.is_tensor(v) else v for k, v in sd.items()} for sd in (ours[0], theirs[0])
    ]
    state = [
        {n: {k: local(v) for k, v in s.items()} for n, s in o["state"].items()} for o in (ours[1], theirs[1])
    ]
    return (
        same_nested(*locals_) and same_nested(*state) and ours[1]["param_groups"] == theirs[1]["param_groups"]
    )


def test_each_rank_holds_about_a_1_over_n_share(trial, tmp_path):
    """At 2 and 4 ranks, against a DDP rank (whole copies: the same bytes at any world size)."""
    plan, _, _ = trial
    text_dir = pathlib.Path(plan.study.data.train).parent
    per_rank = {}
    for strategy, world in (("ddp", 2), ("fsdp", 2), ("fsdp", 4)):
        folder = tmp_path / f"{strategy}-{world}"
        folder.mkdir()
        p = lm_plan(text_dir, folder, strategy, workers=world)
        per_rank[strategy, world] = run_gloo(one_step_bytes, world, folder, p)
    whole = {n: p.numel() for n, p in workloads.get("lm").build_model(LM_HPARAMS).named_parameters()}
    ddp = per_rank["ddp", 2][0]
    assert ddp["numels"] == whole
    for world in (2, 4):
        fsdp = per_rank["fsdp", world]
        assert all(r["as_torch_makes_them"] for r in per_rank["ddp", 2] + fsdp)
        for name, numel in whole.items():  # uneven dimensions: every element on exactly one rank
            assert sum(r["numels"][name] for r in fsdp) == numel, (world, name)
        for part in ("params", "grads", "optimizer"):
            for r in fsdp:
                assert r[part] / ddp[part] <= 1 / world + 0.05, (world, part, r[part], ddp[part])


def evaluate_on(rank: int, world: int, checkpoint: str) -> dict:
    topo = Topology(world_rank=rank, world_size=world, local_rank=rank, workers_per_host=world)
    return evaluate_checkpoint(checkpoint, "validation", topo)


@pytest.mark.parametrize("world", [1, 4])
def test_offline_evaluation_on_any_number_of_ranks_is_the_trials_own(trial, tmp_path, world):
    plan, rows, ckpt = trial
    if world == 1:
        result = evaluate_checkpoint(str(ckpt), "validation", Topology())
    else:
        result = run_gloo(evaluate_on, world, tmp_path, str(ckpt))[0]
    assert result["count"] == rows[-1]["validation/count"]
    assert result["loss"] == rows[-1]["validation/loss"]  # the same weights, the same per-example values
    # One prediction per validation sequence, in the trial's (its ranks in lockstep, padded with
    # zero-weight batches) and offline: the padding adds no row.
    for uri in (plan.predictions_uri("validation", 12), predictions_uri(str(ckpt), "validation")):
        ids = pq.read_table(uri).column("example_id").to_pylist()
        assert len(ids) == len(set(ids)) == result["count"], uri


def plain_validation_loss(state_dict: dict, plan) -> float:
    """The exported weights in the plain model, evaluated in one process on the whole split."""
    workload = workloads.get("lm")
    model = workload.build_model(plan.hparams)
    model.load_state_dict(state_dict)
    ranges = row_ranges(list_files(plan.study.data.validation), 0, 1)
    return evaluate(model, workload, eval_batches(workload, ranges, 6), 6, "cpu")["loss"]


def test_the_exported_file_loads_into_the_plain_model_and_reproduces_the_trial(trial, tmp_path):
    from safetensors.torch import load_file

    plan, rows, ckpt = trial
    for fmt in ("torch", "safetensors"):
        assert main(["export", str(ckpt), "--out", str(tmp_path / f"model.{fmt}"), "--format", fmt]) == 0
    weights = torch.load(tmp_path / "model.torch", weights_only=True)
    assert plain_validation_loss(weights, plan) == rows[-1]["validation/loss"]
    read_back = load_file(str(tmp_path / "model.safetensors"))
    assert read_back.keys() == weights.keys()
    assert all(torch.equal(read_back[k], weights[k]) for k in weights)


def load_on(rank: int, world: int, checkpoints: list[str]) -> list[str]:
    """What loading each checkpoint says on this rank."""
    messages = []
    for uri in checkpoints:
        try:
            sharded.load_state(uri, rank, world)
            messages.append("loaded")
        except CheckpointError as e:
            messages.append(str(e))
    return messages


DAMAGES = {"missing": "is missing", "truncated": "bytes", "flipped": "does not match"}
"""A shard deleted, cut to half, one byte changed: what the refusal says of each."""


def test_a_checkpoint_with_a_bad_shard_is_refused_naming_it(trial, tmp_path):
    _, _, ckpt = trial
    copies = {}
    for damage in DAMAGES:
        copies[damage] = tmp_path / damage / "checkpoint_00000012"
        shutil.copytree(ckpt, copies[damage])
        shard = copies[damage] / "model" / "__1_0.distcp"  # checked by rank 1 (the ranks share the reads)
        data = shard.read_bytes()
        if damage == "missing":
            shard.unlink()
        elif damage == "truncated":
            shard.write_bytes(data[: len(data) // 2])
        else:
            shard.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    messages = run_gloo(load_on, 2, tmp_path, [str(c) for c in copies.values()])
    for (damage, said), rank0, rank1 in zip(DAMAGES.items(), *messages, strict=True):
        assert rank0 == rank1 and "model/__1_0.distcp" in rank0 and said in rank0, (damage, rank0, rank1)
        stderr = io.StringIO()
        with redirect_stderr(stderr):
            code = main(["export", str(copies[damage]), "--out", str(tmp_path / "model.pt")])
        assert code == 2 and not (tmp_path / "model.pt").exists()
        assert stderr.getvalue().count("\n") == 1 and "model/__1_0.distcp" in stderr.getvalue()


def test_a_trial_whose_newest_checkpoint_lost_a_shard_resumes_from_the_one_before(trial, tmp_path):
    plan, rows, _ = trial
    text_dir = pathlib.Path(plan.study.data.train).parent
    cut = lm_plan(text_dir, tmp_path / "storage")
    (tmp_path / "first").mkdir(), (tmp_path / "again").mkdir()
    run_gloo(train_rank, 2, tmp_path / "first", cut, 3)  # stops after the step-12 report
    (pathlib.Path(cut.trial_uri) / "checkpoint_00000012" / "model" / "__0_0.distcp").unlink()
    again = run_gloo(train_rank, 2, tmp_path / "again", cut)[0]["metrics"]
    assert [r["step"] for r in again] == [12]  # from step 8, not from scratch and not from the torn one
    assert without_timing(again[0]) == without_timing(rows[-1])


def test_sharded_checkpoints_on_gcs_resume_to_the_same_result(trial, gcs_emulator, tmp_path):
    """gs:// storage (gcsfs on the emulator): each rank uploads its shards, rank 0 the manifest
    last; the cut trial resumes from the shards read back through fsspec, to the local run's rows."""
    plan, rows, _ = trial
    text_dir = pathlib.Path(plan.study.data.train).parent
    remote = lm_plan(text_dir, f"{gcs_emulator}/fsdp-{tmp_path.name}")
    (tmp_path / "first").mkdir(), (tmp_path / "again").mkdir()
    before = run_gloo(train_rank, 2, tmp_path / "first", remote, 2)[0]["metrics"]
    after = run_gloo(train_rank, 2, tmp_path / "again", remote)[0]["metrics"]
    assert [r["step"] for r in before + after] == [4, 8, 12]
    assert [without_timing(r) for r in before + after] == [without_timing(r) for r in rows]


def save_after_a_later_attempt(rank: int, world: int, trial_uri: str) -> str:
    """Every rank holds attempt 1; then attempt 2 claims the trial (another worker group): the
    sharded save of attempt 1 is refused on every rank, before any shard is written."""
    import torch.distributed as dist

    from service.distributed import fence
    from service.distributed.checkpoint import TrialState
    from service.distributed.sharded import ShardedCheckpointStore

    box = [fence.claim(trial_uri) if rank == 0 else None]
    dist.broadcast_object_list(box)
    fence.hold(box[0])
    store = ShardedCheckpointStore(trial_uri, 2, "validation/loss", "min", rank)
    dist.barrier()
    if rank == 0:
        later = fence.claim(trial_uri)  # what a restarted group's rank 0 does
        fence.hold(box[0])  # this process still holds the stale attempt
        assert later.attempt == 2
    dist.barrier()
    try:
        store.save(TrialState(4, {"w": torch.zeros(2)}, {}), {"step": 4})
    except fence.StaleAttemptError as e:
        return str(e)
    return "saved"


def test_a_superseded_worker_group_writes_no_shard(tmp_path):
    trial = tmp_path / "trial"
    messages = run_gloo(save_after_a_later_attempt, 2, tmp_path, str(trial))
    assert all("superseded by attempt 2" in m for m in messages), messages
    assert not [p for p in trial.rglob("*") if "checkpoint" in p.name or p.suffix == ".distcp"]


def test_a_sharded_checkpoint_resumes_a_trial_on_another_number_of_workers(trial, tmp_path, capfd):
    """Cut after step 8 on 2 ranks, rerun on 4 (a layout change): every rank reads its part of
    the 2-rank shards, the trial goes on from step 8 and finishes; the ranks' random draws cannot
    continue as before, which rank 0 says."""
    plan, _, _ = trial
    text_dir = pathlib.Path(plan.study.data.train).parent
    two = lm_plan(text_dir, tmp_path / "storage")
    four = lm_plan(text_dir, tmp_path / "storage", workers=4)
    (tmp_path / "first").mkdir(), (tmp_path / "again").mkdir()
    run_gloo(train_rank, 2, tmp_path / "first", two, 2)
    again = run_gloo(train_rank, 4, tmp_path / "again", four)[0]["metrics"]
    assert [r["step"] for r in again] == [12]
    with open(four.topology_uri) as f:
        assert {r["resumed_from_step"] for r in json.load(f)["ranks"]} == {8}
    assert "resumed on 4 ranks from a checkpoint of 2" in capfd.readouterr().out
