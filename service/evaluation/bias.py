"""Is a sampled evaluation biased? Compare a fixed eval sample against the full set.

Evaluating on a fixed subset is cheaper than on the whole validation set, but the playbook warns
that a sampled eval must not be biased: the sample should be fixed (the same examples at every
evaluation, so curves are comparable) and its metric should sit within sampling noise of the
full set's. `sample_gap` measures the gap and the noise a simple random sample of that size
would show (drawn without replacement, hence the finite population correction), and flags a gap
larger than that.
"""

from __future__ import annotations

import math

import numpy as np


def fixed_sample(num_examples: int, sample_size: int, seed: int) -> np.ndarray:
    """Sorted indices of `sample_size` of `num_examples` examples, drawn without replacement and
    the same for a given seed; all indices when `sample_size >= num_examples`."""
    if num_examples < 0 or sample_size < 0:
        raise ValueError(f"fixed_sample needs non-negative sizes, got {num_examples}, {sample_size}")
    if sample_size >= num_examples:
        return np.arange(num_examples)
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(num_examples, size=sample_size, replace=False))


def sample_gap(
    sample_values: np.ndarray,
    full_values: np.ndarray,
    z: float = 1.96,
    sample_weights: np.ndarray | None = None,
    full_weights: np.ndarray | None = None,
) -> dict:
    """Gap between the sample's and the full set's weighted mean of a per-example metric (e.g.
    0/1 errors; weights: 1 each, or the examples' own, such as a sequence's token count).

    The sample is a subset of the full set drawn without replacement, so the standard error of
    its (ratio) mean is sqrt((1 - n/N) * S^2 / n) / w_mean, S^2 the full set's variance (ddof=1)
    of w * (x - full mean) and w_mean its mean weight: with unit weights, the plain mean's.
    Returns sample_mean, full_mean, gap (sample - full), se, ci_low/ci_high (gap -/+ z*se),
    sample_size, full_size and `biased`: |gap| > z*se (plus a rounding epsilon, so the full set
    as its own sample never is).
    """
    sample, sw = _values_and_weights(sample_values, sample_weights)
    full, fw = _values_and_weights(full_values, full_weights)
    n, big_n = len(sample), len(full)
    if n == 0 or n > big_n:
        raise ValueError(f"sample_gap needs 0 < sample size <= full size, got {n} and {big_n}")
    sample_mean, full_mean = float(np.sum(sw * sample) / np.sum(sw)), float(np.sum(fw * full) / np.sum(fw))
    residuals = fw * (full - full_mean)
    variance = float(np.sum(residuals**2) / (big_n - 1)) if big_n > 1 else 0.0
    se = math.sqrt(max(0.0, 1 - n / big_n) * variance / n) / float(np.mean(fw))
    gap = sample_mean - full_mean
    eps = 1e-9 * max(1.0, abs(full_mean))
    return {
        "sample_mean": sample_mean,
        "full_mean": full_mean,
        "gap": gap,
        "se": se,
        "ci_low": gap - z * se,
        "ci_high": gap + z * se,
        "sample_size": n,
        "full_size": big_n,
        "biased": abs(gap) > z * se + eps,
    }


def _values_and_weights(values: np.ndarray, weights: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(values, dtype=np.float64).ravel()
    w = np.ones_like(x) if weights is None else np.asarray(weights, dtype=np.float64).ravel()
    if w.shape != x.shape:
        raise ValueError(f"sample_gap: {len(w)} weights for {len(x)} values")
    return x, w
