"""Evaluation core: padded eval batches, weighted metrics, per-class report, sampled-eval bias."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.special import log_softmax
from scipy.stats import norm
from sklearn.datasets import load_digits
from sklearn.metrics import accuracy_score, confusion_matrix, precision_recall_fscore_support

from service.evaluation.bias import fixed_sample, sample_gap
from service.evaluation.metrics import WeightedSums, examples_for_change, per_class, wilson_interval
from service.evaluation.padding import pad_batch
from service.workloads.digits import Digits

Z = norm.ppf(0.975)


def textbook_wilson(x: int, n: int, z: float = Z) -> tuple[float, float]:
    """Wilson (1927) score interval, written out independently of the code under test."""
    p = x / n
    centre = (2 * x + z**2) / (2 * (n + z**2))
    half = z * math.sqrt(n) / (n + z**2) * math.sqrt(p * (1 - p) + z**2 / (4 * n))
    return centre - half, centre + half


def digits_batch(n: int) -> dict[str, torch.Tensor]:
    x, y = load_digits(return_X_y=True)
    return {
        "features": torch.tensor(x[:n] / 16.0, dtype=torch.float32).view(-1, 1, 8, 8),
        "label": torch.tensor(y[:n], dtype=torch.int64),
        "example_id": torch.arange(100, 100 + n, dtype=torch.int64),
    }


# --- padding ---------------------------------------------------------------------------------


def test_pad_batch_shapes_weights_and_fill_values():
    batch = digits_batch(5)
    padded = pad_batch(batch, 8)
    assert set(padded) == {"features", "label", "example_id", "weight"}
    for k, v in batch.items():
        assert padded[k].shape == (8, *v.shape[1:]) and padded[k].dtype == v.dtype
        np.testing.assert_array_equal(padded[k][:5].numpy(), v.numpy())
    np.testing.assert_array_equal(padded["features"][5:].numpy(), np.zeros((3, 1, 8, 8)))
    np.testing.assert_array_equal(padded["label"][5:].numpy(), [0, 0, 0])
    np.testing.assert_array_equal(padded["example_id"][5:].numpy(), [-1, -1, -1])
    assert padded["weight"].dtype.is_floating_point
    np.testing.assert_array_equal(padded["weight"].numpy(), [1, 1, 1, 1, 1, 0, 0, 0])


def test_pad_batch_full_batch_gets_unit_weights_and_existing_weight_is_extended():
    batch = digits_batch(4)
    full = pad_batch(batch, 4)
    np.testing.assert_array_equal(full["weight"].numpy(), np.ones(4))
    np.testing.assert_array_equal(full["label"].numpy(), batch["label"].numpy())
    again = pad_batch({**batch, "weight": torch.tensor([0.5, 1.0, 2.0, 1.0])}, 6)
    np.testing.assert_array_equal(again["weight"].numpy(), [0.5, 1.0, 2.0, 1.0, 0.0, 0.0])
    assert again["label"].shape == (6,)


def test_pad_batch_rejects_oversized_and_ragged_batches():
    with pytest.raises(ValueError):
        pad_batch(digits_batch(5), 4)
    with pytest.raises(ValueError):
        pad_batch({"label": torch.zeros(3, dtype=torch.int64), "example_id": torch.zeros(2)}, 4)


@pytest.mark.parametrize("eval_batch_size", [60, 64, 500])  # divides 300, does not, larger than the set
def test_padded_batches_give_the_full_set_metrics(eval_batch_size):
    workload = Digits()
    torch.manual_seed(0)
    model = workload.build_model({"width": 4}).eval()
    data = digits_batch(300)
    sums = WeightedSums(workload.metric_names, num_classes=workload.num_classes)
    with torch.no_grad():
        for start in range(0, 300, eval_batch_size):
            batch = pad_batch(
                {k: v[start : start + eval_batch_size] for k, v in data.items()}, eval_batch_size
            )
            assert all(len(v) == eval_batch_size for v in batch.values())
            outputs = workload.forward(model, batch)
            per_example = workload.metrics(outputs, batch)
            sums.add(per_example, batch["weight"], batch["label"], outputs.argmax(dim=1))
        logits = model(data["features"]).double().numpy()  # one unpadded pass over the whole set
    labels = data["label"].numpy()
    predictions = logits.argmax(axis=1)
    got = sums.result()
    assert got["count"] == 300
    assert got["loss"] == pytest.approx(-log_softmax(logits, axis=1)[np.arange(300), labels].mean(), rel=1e-5)
    assert got["error"] == pytest.approx(1 - accuracy_score(labels, predictions), abs=1e-12)
    np.testing.assert_array_equal(
        sums.confusion.numpy(), confusion_matrix(labels, predictions, labels=range(10))
    )


# --- WeightedSums (single process; across ranks in test_evaluation_gloo.py) ------------------


def test_weighted_sums_use_the_weights_and_ignore_padded_nans():
    rng = np.random.default_rng(1)
    values = rng.normal(size=40)
    weights = rng.uniform(0.1, 3.0, size=40)
    weights[30:] = 0.0
    values[35:] = np.nan  # garbage in padded rows must not leak into the result
    sums = WeightedSums(["loss"])
    for start in (0, 16, 32):
        sl = slice(start, start + 16)
        sums.add({"loss": torch.tensor(values[sl])}, torch.tensor(weights[sl]))
    sums.all_reduce()  # no process group: a no-op
    got = sums.result()
    assert got["count"] == 30
    assert got["loss"] == pytest.approx(np.average(values[:30], weights=weights[:30]), rel=1e-12)
    with pytest.raises(RuntimeError):
        sums.all_reduce()


def test_weighted_sums_without_examples_and_with_wrong_metric_names():
    sums = WeightedSums(["loss", "error"], num_classes=3)
    got = sums.result()
    assert got["count"] == 0 and math.isnan(got["loss"]) and math.isnan(got["error"])
    np.testing.assert_array_equal(sums.confusion.numpy(), np.zeros((3, 3)))
    with pytest.raises(ValueError):
        sums.add({"loss": torch.zeros(2)}, torch.ones(2), torch.zeros(2), torch.zeros(2))


# --- per-class report -------------------------------------------------------------------------


def test_per_class_matches_sklearn():
    rng = np.random.default_rng(2)
    labels = rng.integers(0, 5, size=400)
    predictions = np.where(rng.random(400) < 0.6, labels, rng.integers(0, 4, size=400))  # 4 never guessed
    predictions[labels == 4] = 3  # ... and never right: precision of class 4 undefined, recall 0
    rows = per_class(confusion_matrix(labels, predictions, labels=range(5)))
    precision, recall, _, support = precision_recall_fscore_support(
        labels, predictions, labels=range(5), zero_division=np.nan
    )
    assert [r["class"] for r in rows] == list(range(5))
    np.testing.assert_array_equal([r["support"] for r in rows], support)
    np.testing.assert_array_equal([r["predicted"] for r in rows], np.bincount(predictions, minlength=5))
    np.testing.assert_array_equal(
        [r["true_positives"] for r in rows], np.bincount(labels[labels == predictions], minlength=5)
    )
    np.testing.assert_allclose([r["precision"] for r in rows], precision, rtol=1e-12)
    np.testing.assert_allclose([r["recall"] for r in rows], recall, rtol=1e-12)
    for r in rows:
        if r["support"]:
            np.testing.assert_allclose(
                r["recall_interval"], textbook_wilson(r["true_positives"], r["support"])
            )
        if r["predicted"]:
            np.testing.assert_allclose(
                r["precision_interval"], textbook_wilson(r["true_positives"], r["predicted"])
            )
    assert rows[4]["precision_interval"] == (0.0, 1.0)  # nothing predicted: no information


# Newcombe (1998), "Two-sided confidence intervals for the single proportion: comparison of seven
# methods", Statistics in Medicine 17:857-872, Table II, method 3 (Wilson score, no correction).
NEWCOMBE_WILSON = [
    (81, 263, (0.2553, 0.3662)),
    (15, 148, (0.0624, 0.1605)),
    (0, 20, (0.0000, 0.1611)),
    (1, 29, (0.0061, 0.1718)),
]


@pytest.mark.parametrize("successes,n,expected", NEWCOMBE_WILSON)
def test_wilson_interval_matches_published_values(successes, n, expected):
    got = wilson_interval(successes, n)
    np.testing.assert_allclose(got, expected, atol=5e-5)
    np.testing.assert_allclose(got, np.clip(textbook_wilson(successes, n), 0, 1), rtol=1e-12, atol=1e-15)


def test_wilson_interval_edge_cases():
    assert wilson_interval(0, 0) == (0.0, 1.0)
    low, high = wilson_interval(7, 7)
    assert high == 1.0 and low == pytest.approx(textbook_wilson(7, 7)[0])
    with pytest.raises(ValueError):
        wilson_interval(5, 4)


def test_examples_for_change():
    assert examples_for_change(27, 0.05) == pytest.approx(1.35)  # +0.05 recall on 27 = 1.35 examples
    assert examples_for_change(27, 0.01) == pytest.approx(0.27)


# --- sampled-eval bias ------------------------------------------------------------------------


def test_fixed_sample_is_fixed_sorted_and_without_replacement():
    a = fixed_sample(1000, 100, seed=3)
    np.testing.assert_array_equal(a, fixed_sample(1000, 100, seed=3))
    assert not np.array_equal(a, fixed_sample(1000, 100, seed=4))
    assert len(a) == 100 and len(np.unique(a)) == 100
    assert np.all(np.diff(a) > 0) and a.min() >= 0 and a.max() < 1000
    np.testing.assert_array_equal(fixed_sample(50, 50, seed=0), np.arange(50))
    np.testing.assert_array_equal(fixed_sample(50, 80, seed=0), np.arange(50))


def full_set(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Per-example losses of 1000 examples and their 0/1 errors (high loss -> likely error)."""
    rng = np.random.default_rng(seed)
    losses = rng.exponential(0.7, size=1000)
    errors = (losses + rng.normal(0, 0.3, size=1000) > 1.0).astype(np.float64)
    return losses, errors


def test_standard_error_is_the_spread_of_random_sample_means():
    losses, _ = full_set()
    n = 300
    got = sample_gap(losses[fixed_sample(1000, n, seed=0)], losses)
    fpc_formula = math.sqrt((1 - n / 1000) * np.var(losses, ddof=1) / n)
    assert got["se"] == pytest.approx(fpc_formula, rel=1e-12)
    # Monte Carlo: the standard deviation of the means of many random samples without replacement.
    rng = np.random.default_rng(5)
    draws = np.argsort(rng.random((4000, 1000)), axis=1)[:, :n]
    assert got["se"] == pytest.approx(losses[draws].mean(axis=1).std(), rel=0.04)
    assert got["sample_mean"] == pytest.approx(losses[fixed_sample(1000, n, seed=0)].mean())
    assert got["gap"] == pytest.approx(got["sample_mean"] - losses.mean())
    assert got["ci_low"] == pytest.approx(got["gap"] - 1.96 * got["se"])
    assert got["ci_high"] == pytest.approx(got["gap"] + 1.96 * got["se"])


def test_skewed_sample_is_flagged():
    losses, errors = full_set()
    hardest = np.argsort(losses)[-100:]
    for values in (losses, errors):
        got = sample_gap(values[hardest], values)
        assert got["biased"] and got["gap"] > 0 and got["ci_low"] > 0
    easiest = np.argsort(losses)[:100]
    assert sample_gap(errors[easiest], errors)["biased"]


def test_random_samples_are_flagged_at_about_the_nominal_rate():
    _, errors = full_set()
    flagged = sum(sample_gap(errors[fixed_sample(1000, 100, seed=s)], errors)["biased"] for s in range(200))
    assert 2 <= flagged < 15  # nominal 5% of 200 = 10; 0 would mean an inflated standard error


def test_full_set_as_its_own_sample_is_not_flagged():
    losses, errors = full_set()
    shuffled = np.random.default_rng(0).permutation(1000)
    for values in (losses, errors):
        got = sample_gap(values[shuffled], values)
        assert got["se"] == 0.0 and abs(got["gap"]) < 1e-12 and not got["biased"]
    with pytest.raises(ValueError):
        sample_gap(np.array([]), errors)


def test_weighted_gap_of_sequences_weighted_by_their_tokens():
    """A language model's per-sequence losses weighted by token counts (short sequences lose
    more): the sampled eval's gap is between token-weighted means, and its standard error the
    spread of the weighted means of random samples; unit weights give the unweighted answer."""
    from service.evaluation.sampling import EvalSample, bias_fields

    rng = np.random.default_rng(3)
    tokens = np.where(rng.random(1000) < 0.3, rng.integers(1, 64, 1000), 64).astype(np.float64)
    losses = rng.gamma(4.0, 0.5, 1000) + 40.0 / tokens
    n = 300
    positions = fixed_sample(1000, n, seed=0)
    rows = {"metric/loss": losses, "weight": tokens}
    got = bias_fields(rows, EvalSample(positions, torch.from_numpy(positions)), "loss")
    weighted = lambda i: np.sum(losses[i] * tokens[i]) / np.sum(tokens[i])  # noqa: E731
    assert got["sample_gap"] == pytest.approx(weighted(positions) - weighted(np.arange(1000)), rel=1e-12)
    draws = np.argsort(rng.random((4000, 1000)), axis=1)[:, :n]
    spread = np.std([weighted(d) for d in draws])
    full = sample_gap(losses[positions], losses, sample_weights=tokens[positions], full_weights=tokens)
    assert full["se"] == pytest.approx(spread, rel=0.05)
    unit = sample_gap(losses[positions], losses, sample_weights=np.ones(n), full_weights=np.ones(1000))
    assert unit == sample_gap(losses[positions], losses)
