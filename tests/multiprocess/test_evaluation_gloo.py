"""WeightedSums across gloo ranks with uneven shards (one empty): the exact full-set metrics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from service.evaluation.metrics import WeightedSums
from service.evaluation.padding import pad_batch
from tests.helpers.gloo import run_gloo

NUM_EXAMPLES, NUM_CLASSES, EVAL_BATCH = 103, 5, 16
SHARDS = {1: [103], 2: [30, 73], 3: [0, 40, 63]}  # uneven, rank 0 of 3 has nothing


def predictions_and_labels() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    labels = rng.integers(0, NUM_CLASSES, size=NUM_EXAMPLES)
    logits = rng.normal(size=(NUM_EXAMPLES, NUM_CLASSES)) + 1.5 * np.eye(NUM_CLASSES)[labels]
    return logits.astype(np.float32), labels


def eval_rank(rank, world):
    """This rank's shard in padded batches; the logits stand in for a model's outputs (a padded
    row's zero logits predict class 0, its label, so unweighted padding would lower the error)."""
    logits, labels = predictions_and_labels()
    start = sum(SHARDS[world][:rank])
    stop = start + SHARDS[world][rank]
    sums = WeightedSums(("loss", "error"), num_classes=NUM_CLASSES)
    num_batches = 0
    for b in range(start, stop, EVAL_BATCH):
        end = min(b + EVAL_BATCH, stop)
        batch = pad_batch(
            {
                "features": torch.from_numpy(logits[b:end]),
                "label": torch.from_numpy(labels[b:end]),
                "example_id": torch.arange(b, end),
            },
            EVAL_BATCH,
        )
        outputs = batch["features"]
        per_example = {
            "loss": F.cross_entropy(outputs, batch["label"], reduction="none"),
            "error": (outputs.argmax(dim=1) != batch["label"]).float(),
        }
        sums.add(per_example, batch["weight"], batch["label"], outputs.argmax(dim=1))
        num_batches += 1
    sums.all_reduce()
    return {"result": sums.result(), "confusion": sums.confusion, "num_batches": num_batches}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_all_reduced_metrics_equal_the_full_set(world, tmp_path):
    # Imported here, not at module level: the spawned ranks import this module and need neither.
    from scipy.special import log_softmax
    from sklearn.metrics import accuracy_score, confusion_matrix

    results = run_gloo(eval_rank, world, tmp_path)
    logits, labels = predictions_and_labels()
    predictions = logits.argmax(axis=1)
    loss = -log_softmax(logits.astype(np.float64), axis=1)[np.arange(NUM_EXAMPLES), labels].mean()
    expected_confusion = confusion_matrix(labels, predictions, labels=range(NUM_CLASSES))
    assert [r["num_batches"] for r in results] == [-(-n // EVAL_BATCH) for n in SHARDS[world]]
    for r in results:  # every rank holds the full-set result
        assert r["result"]["count"] == NUM_EXAMPLES
        assert r["result"]["loss"] == pytest.approx(loss, rel=1e-6)
        assert r["result"]["error"] == pytest.approx(1 - accuracy_score(labels, predictions), abs=1e-12)
        np.testing.assert_array_equal(r["confusion"].numpy(), expected_confusion)
