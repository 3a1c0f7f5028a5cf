"""The fast path's checkpoint store: best-N + latest retention (against a plain sort), crashed
writes never selectable, async saves isolated from later training (tensors and history), errors
surfaced, and the loop's checkpoints through the store equal to those it hands a Reporter."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch

from service.distributed import checkpoint
from service.distributed.checkpoint import TrialState
from service.distributed.checkpoint_store import AsyncCheckpointer, CheckpointStore, SyncCheckpointer
from service.distributed.topology import Topology
from service.trainer.loop import train
from tests.helpers.studies import same_nested
from tests.helpers.trainer_runs import Reporter, make_plan


def state_at(step: int, value: float = 0.0) -> TrialState:
    return TrialState(step, {"w": torch.full((3,), value)}, {}, [torch.get_rng_state()], [{"step": step}], {})


@pytest.mark.parametrize("root", ["local", "memory"])
@pytest.mark.parametrize("mode", ["min", "max"])
def test_keeps_the_n_best_and_the_latest(tmp_path, root, mode):
    uri = str(tmp_path / "trial") if root == "local" else f"memory://store-{mode}/trial"
    store = CheckpointStore(uri, 2, "validation/loss", mode)
    scores = np.random.default_rng(3).random(9)
    for step, score in enumerate(scores, start=1):
        store.save(state_at(step, float(score)), {"step": step, "validation/loss": float(score)})
    store.close()
    order = np.argsort(scores if mode == "min" else -scores)
    expected = {int(i) + 1 for i in order[:2]} | {len(scores)}
    assert [m["step"] for _, m in store.complete()] == sorted(expected)
    latest = store.latest_state()
    assert latest.step == len(scores)
    assert torch.equal(latest.model["w"], torch.full((3,), float(scores[-1])))


def test_a_crashed_write_is_never_selectable(tmp_path):
    store = CheckpointStore(str(tmp_path), 3, "validation/loss", "min")
    store.save(state_at(10), {"step": 10, "validation/loss": 1.0})
    # A save killed before its rename: a hidden partial directory with a whole state.pt in it.
    partial = tmp_path / ".partial-checkpoint_00000020-dead"
    checkpoint.save(state_at(20), str(partial), {"step": 20, "validation/loss": 0.5})
    # An object-store save killed between state.pt and meta.json.
    torn = tmp_path / "checkpoint_00000030"
    torn.mkdir()
    torch.save({"format": checkpoint.FORMAT_VERSION, **state_at(30).__dict__}, torn / checkpoint.STATE_FILE)
    assert [m["step"] for _, m in store.complete()] == [10]
    assert store.latest_state().step == 10
    CheckpointStore(str(tmp_path), 3, "validation/loss", "min")  # a restarted trial's store
    assert not partial.exists()


def test_async_save_is_isolated_from_later_steps(tmp_path):
    store = CheckpointStore(str(tmp_path), 5, "validation/loss", "min")
    saver = AsyncCheckpointer(store)
    weights = torch.arange(1_000_000, dtype=torch.float32)
    expected = []
    for step in range(1, 4):
        saver.save(TrialState(step, {"w": weights}, {}, [], [], {}), {"step": step, "validation/loss": 1.0})
        expected.append(weights.clone())
        weights.mul_(2.0).add_(1.0)  # the next training steps change the live tensor in place
    saver.close()
    for (uri, _), want in zip(store.complete(), expected, strict=True):
        assert torch.equal(checkpoint.load(uri).model["w"], want)


def test_async_save_is_isolated_from_later_changes_to_the_history(tmp_path):
    store = CheckpointStore(str(tmp_path), 5, "validation/loss", "min")
    saver = AsyncCheckpointer(store)
    history = [{"step": 1, "validation/per_class": [[3, 1], [0, 5]]}]
    saver.save(TrialState(1, {}, {}, [], history, {}), {"step": 1, "validation/loss": 1.0})
    history[0]["validation/per_class"][0][0] = 99  # nested values changed in place afterwards
    history.append({"step": 2})
    saver.close()
    [(uri, _)] = store.complete()
    assert checkpoint.load(uri).history == [{"step": 1, "validation/per_class": [[3, 1], [0, 5]]}]


def test_a_failed_background_save_is_raised(tmp_path):
    saver = AsyncCheckpointer(CheckpointStore(str(tmp_path), 2, "validation/loss", "min"))
    bad = TrialState(1, {"w": torch.zeros(2)}, {}, [], [], {"not picklable": lambda: None})
    saver.save(bad, {"step": 1, "validation/loss": 1.0})
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        saver.close()
    assert CheckpointStore(str(tmp_path), 2, "validation/loss", "min").complete() == []


def without_timing(history: list[dict]) -> str:
    from service.trainer.loop import TIMING_FIELDS

    return json.dumps([{k: v for k, v in row.items() if k not in TIMING_FIELDS} for row in history])


def test_loop_checkpoints_through_the_store_equal_the_reported_ones(digits_dir, tmp_path):
    plan = make_plan(digits_dir, tmp_path / "reported")
    reporter = Reporter(tmp_path)
    train(plan, Topology(), reporter)
    for saver_kind in (SyncCheckpointer, AsyncCheckpointer):
        plan_b = make_plan(digits_dir, tmp_path / saver_kind.__name__)
        tr = plan_b.study.training
        store = CheckpointStore(plan_b.trial_uri, 10, tr.metric, tr.mode)
        train(plan_b, Topology(), Reporter(tmp_path / "unused"), checkpointer=saver_kind(store))
        stored = {m["step"]: uri for uri, m in store.complete()}
        assert sorted(stored) == [m["step"] for m, _ in reporter.reports]
        for metrics, directory in reporter.reports:
            want, got = checkpoint.load(directory), checkpoint.load(stored[metrics["step"]])
            assert got.step == want.step
            assert without_timing(got.history) == without_timing(want.history)
            for key in want.model:
                assert torch.equal(got.model[key], want.model[key]), key
            assert same_nested(got.rng_states, want.rng_states)


# Ties of the ranking metric: one rule (the later evaluation ranks higher) for retention and for
# the trial's best, so the best checkpoint is always one that is kept.
TIED = [0.5, 0.3, 0.3, 0.4, 0.3, 0.6]  # validation/error at steps 1..6: steps 2, 3, 5 tie for the best


def test_on_a_tie_the_later_evaluation_is_the_best_and_is_kept(tmp_path):
    from service.core.ranking import best_row

    history = [{"step": step, "validation/error": v} for step, v in enumerate(TIED, start=1)]
    assert best_row(history, "validation/error", "min")["step"] == 5
    store = CheckpointStore(str(tmp_path), 2, "validation/error", "min")
    for row in history:
        store.save(state_at(row["step"]), row)
    store.close()
    # By hand: the two best are steps 5 and 3 (the later ones of the 0.3 tie), plus step 6, the latest.
    assert [m["step"] for _, m in store.complete()] == [3, 5, 6]


@pytest.mark.parametrize("mode", ["min", "max"])
@pytest.mark.parametrize("keep", [1, 2, 3])
def test_the_best_of_a_coarse_metric_is_always_kept(tmp_path, mode, keep):
    from service.core.ranking import best_row

    rng = np.random.default_rng(keep)
    for trial in range(5):
        values = rng.choice([0.25, 0.5, 0.75], size=8).tolist()  # a coarse metric: many ties
        history = [{"step": 10 * i, "validation/error": v} for i, v in enumerate(values, start=1)]
        store = CheckpointStore(str(tmp_path / f"{mode}-{keep}-{trial}"), keep, "validation/error", mode)
        for row in history:
            store.save(state_at(row["step"]), row)
        store.close()
        # Independently: the best value, its last step, and the keep best by (value, later step).
        best_value = min(values) if mode == "min" else max(values)
        last_best_step = max(r["step"] for r in history if r["validation/error"] == best_value)
        signed = [(v if mode == "min" else -v, -r["step"]) for r, v in zip(history, values, strict=True)]
        expected = {-s for _, s in sorted(signed)[:keep]} | {history[-1]["step"]}
        kept = {m["step"] for _, m in store.complete()}
        assert best_row(history, "validation/error", mode)["step"] == last_best_step
        assert kept == expected
        assert last_best_step in kept
