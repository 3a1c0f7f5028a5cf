"""Multi-worker trials on a reused pool (`scaling.reuse_workers`), on the session's Ray cluster:
a round of 2-worker trials runs on the same processes trial after trial, and each trial's
results (every evaluation row, the final weights, optimizer state and every rank's RNG state)
are bitwise those of the same trial run alone, in a Tune run of its own."""

from __future__ import annotations

import json
import os

import pytest

from service.distributed.checkpoint_store import CheckpointStore
from service.trainer.loop import TIMING_FIELDS
from tests.helpers.studies import make_study, run_within_timeout, same_nested

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
STEPS, EVERY = 12, 6
# Dropout and augmentation draw from every rank's generators; BatchNorm keeps running statistics.
FIXED = {"momentum": 0.9, "width": 4, "dropout": 0.25, "augment": True}


def pooled_study(digits_dir, storage, learning_rates: list[float]):
    """A grid round of 2-worker trials, one per learning rate, on a reused pool."""
    search = {k: {"role": "fixed", "value": v} for k, v in FIXED.items()}
    search["learning_rate"] = {"role": "nuisance", "type": "choice", "values": learning_rates}
    return make_study(
        digits_dir,
        storage,
        name="pool",
        scaling={"num_hosts": 1, "workers_per_host": 2, "reuse_workers": True},
        training={"max_train_steps": STEPS, "eval_every_steps": EVERY},
        search=search,
        rounds=[{"name": "explore", "kind": "grid", "num_trials": len(learning_rates)}],
    )


def trial_files(study, row) -> tuple[list[dict], list[int], object]:
    """(evaluation rows without timings, every rank's pid, the latest checkpoint's state)."""
    trial_dir = os.path.join(study.study_uri, "trials", row["trial_name"])
    with open(os.path.join(trial_dir, "metrics.jsonl")) as f:
        log = [{k: v for k, v in json.loads(line).items() if k not in TIMING_FIELDS} for line in f]
    with open(os.path.join(trial_dir, "topology.json")) as f:
        pids = [r["pid"] for r in sorted(json.load(f)["ranks"], key=lambda r: r["world_rank"])]
    tr = study.training
    store = CheckpointStore(trial_dir, tr.num_checkpoints_to_keep, tr.metric, tr.mode)
    return log, pids, store.latest_state()


def test_a_round_reuses_its_workers_and_each_trial_equals_itself_alone(ray_cluster, digits_dir, tmp_path):
    rates = [0.3, 0.05, 0.1]
    study = pooled_study(digits_dir, tmp_path / "round", rates)
    rows = sorted(run_within_timeout(study), key=lambda r: r["trial_name"])
    assert [r["status"] for r in rows] == ["FINISHED"] * len(rates)
    runs = [trial_files(study, row) for row in rows]
    assert len(runs[0][1]) == 2 and len(set(runs[0][1])) == 2
    assert all(pids == runs[0][1] for _, pids, _ in runs), "a trial ran on new processes"

    for i in (1, 2):  # the trials that ran after another one on the same processes
        alone_study = pooled_study(digits_dir, tmp_path / f"alone-{i}", [rates[i]])
        (alone_row,) = run_within_timeout(alone_study)
        log, pids, state = runs[i]
        alone_log, alone_pids, alone_state = trial_files(alone_study, alone_row)
        # new processes (not one pid in common could fail by chance: the round's processes have
        # ended and pids are reused; both ranks' pids again, in order, cannot)
        assert alone_pids != pids
        assert log == alone_log
        assert [rows[i][k] for k in ("best_step", "best_metric")] == [
            alone_row[k] for k in ("best_step", "best_metric")
        ]
        assert state.step == alone_state.step == STEPS
        assert same_nested(state.model, alone_state.model)
        assert same_nested(state.optimizer, alone_state.optimizer)
        assert same_nested(state.rng_states, alone_state.rng_states)


def fsdp_study(digits_dir, storage, learning_rates: list[float], reuse: bool):
    """2-worker fsdp trials fed by Ray Data input workers, on a pool (the default) or on a Ray
    Train run each (`reuse_workers: false`)."""
    search = {"momentum": {"role": "fixed", "value": 0.9}, "width": {"role": "fixed", "value": 6}}
    search["learning_rate"] = {"role": "nuisance", "type": "choice", "values": learning_rates}
    scaling = {"workers_per_host": 2, "cpus_per_worker": 0.5, "strategy": "fsdp"}
    return make_study(
        digits_dir,
        storage,
        name="pool-fsdp",
        scaling=scaling if reuse else {**scaling, "reuse_workers": False},
        input={"workers": "ray_data", "num_input_workers": 1, "cpus_per_input_worker": 0.25},
        training={"max_train_steps": STEPS, "eval_every_steps": EVERY},
        search=search,
        rounds=[{"name": "explore", "kind": "grid", "num_trials": len(learning_rates)}],
    )


def shard_files(study, row) -> dict[str, bytes]:
    """Every checkpoint's DCP shard files (checkpoint/model/name -> bytes)."""
    trial_dir = os.path.join(study.study_uri, "trials", row["trial_name"])
    out = {}
    for ckpt in sorted(d for d in os.listdir(trial_dir) if d.startswith("checkpoint_")):
        model = os.path.join(trial_dir, ckpt, "model")
        for name in sorted(os.listdir(model)):
            with open(os.path.join(model, name), "rb") as f:
                out[f"{ckpt}/model/{name}"] = f.read()
    return out


def test_fsdp_trials_with_ray_data_input_on_a_pool_equal_their_ray_train_runs(
    ray_cluster, digits_dir, tmp_path
):
    """The second trial of a pooled round (it ran on the first one's processes, which built and
    sharded a model of their own before) against the same trial as a Ray Train run: the same
    evaluations, bit for bit, and the same shards in every kept checkpoint, one file per rank."""
    rates = [0.3, 0.05]
    study = fsdp_study(digits_dir, tmp_path / "pool", rates, reuse=True)
    rows = sorted(run_within_timeout(study), key=lambda r: r["trial_name"])
    assert [r["status"] for r in rows] == ["FINISHED"] * 2
    (_, first_pids, _), (log, pids, _) = (trial_files(study, row) for row in rows)
    assert pids == first_pids and len(set(pids)) == 2, "the round's trials ran on new processes"

    alone = fsdp_study(digits_dir, tmp_path / "ray-train", rates[1:], reuse=False)
    (alone_row,) = run_within_timeout(alone)
    alone_log, alone_pids, _ = trial_files(alone, alone_row)
    assert set(alone_pids).isdisjoint(pids)
    assert log == alone_log
    shards = shard_files(study, rows[1])
    assert {os.path.basename(k) for k in shards} == {"__0_0.distcp", "__1_0.distcp", ".metadata"}
    alone_shards = shard_files(alone, alone_row)
    assert shards.keys() == alone_shards.keys()
    distcp = [k for k in shards if k.endswith(".distcp")]  # .metadata holds a save's own id
    assert [shards[k] for k in distcp] == [alone_shards[k] for k in distcp]
    with open(os.path.join(study.study_uri, "trials", rows[1]["trial_name"], "metrics.jsonl")) as f:
        assert all(json.loads(line)["input/read_s"] == 0 for line in f)  # Ray Data's actors read
