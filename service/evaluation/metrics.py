"""Weighted, exactly reducible evaluation metrics and a per-class report with error bars.

Metrics are kept as sums (weighted sum of each per-example metric, total weight, example count,
confusion counts) rather than means, so that batches of any size, zero-weight padding and ranks
with uneven shards (even none) combine into the exact full-set value with one all-reduce. The
per-class report puts a Wilson score interval on every precision and recall, and
`examples_for_change` says how many examples a change in a rate stands for, so that small
classes' "improvements" can be judged against the noise (the playbook: know how many examples a
metric difference is worth before believing it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

Z_95 = 1.959963984540054
"""The standard normal 97.5% quantile: two-sided 95% intervals."""


class WeightedSums:
    """Accumulates weighted per-example metrics (and, for classification, a confusion matrix) over
    eval batches; `all_reduce()` sums them over ranks, `result()` gives the weighted means.

    `metric_names` fixes the layout of the reduced tensor, so a rank that saw no batch still
    takes part in the all-reduce. `device` holds the accumulators (a CUDA device for NCCL); sums
    stay on it, so accumulating never synchronises with the host.
    """

    def __init__(
        self,
        metric_names: Sequence[str],
        num_classes: int | None = None,
        device: torch.device | str | None = None,
    ):
        self.metric_names = tuple(metric_names)
        self.num_classes = num_classes
        self.device = torch.device(device or "cpu")
        # [weighted sum of each metric..., total weight, count of weight > 0 rows]
        self._sums = torch.zeros(len(self.metric_names) + 2, dtype=torch.float64, device=self.device)
        k = num_classes or 0
        self._confusion = torch.zeros(k, k, dtype=torch.int64, device=self.device)
        self._reduced = False

    def add(
        self,
        per_example: dict[str, Tensor],
        weight: Tensor,
        labels: Tensor | None = None,
        predictions: Tensor | None = None,
    ) -> None:
        """Add one batch: `per_example` maps each metric name to shape [batch] values, `weight`
        is [batch] (0 for padding). Rows of weight 0 contribute nothing, even NaN values.
        `labels` and `predictions` (class indices) feed the confusion matrix when `num_classes`
        was given."""
        if self._reduced:
            raise RuntimeError("WeightedSums.add after all_reduce()")
        if set(per_example) != set(self.metric_names):
            raise ValueError(f"metrics {sorted(per_example)} != expected {sorted(self.metric_names)}")
        w = weight.to(self.device, torch.float64)
        real = w > 0
        for i, name in enumerate(self.metric_names):
            values = per_example[name].to(self.device, torch.float64)
            if values.shape != w.shape:
                raise ValueError(f"metric {name!r} has shape {tuple(values.shape)}, weight {tuple(w.shape)}")
            self._sums[i] += torch.where(real, values * w, 0.0).sum()
        self._sums[-2] += w.sum()
        self._sums[-1] += real.sum()
        if self.num_classes is not None:
            if labels is None or predictions is None:
                raise ValueError("num_classes was given: add() needs labels and predictions")
            k = self.num_classes
            cells = labels.to(self.device, torch.int64) * k + predictions.to(self.device, torch.int64)
            # scatter_add_ (not boolean indexing or bincount): no host sync on an accelerator.
            self._confusion.view(-1).scatter_add_(0, cells, real.to(torch.int64))

    def all_reduce(self) -> None:
        """Sum over all ranks (a no-op without an initialised process group). Every rank calls it
        exactly once, whatever number of batches it added."""
        if self._reduced:
            raise RuntimeError("WeightedSums.all_reduce called twice (it would double count)")
        self._reduced = True
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(self._sums, op=dist.ReduceOp.SUM)
            if self.num_classes is not None:
                dist.all_reduce(self._confusion, op=dist.ReduceOp.SUM)

    def result(self) -> dict[str, float]:
        """Weighted mean of each metric (NaN when the total weight is 0) and "count", the number
        of real (weight > 0) examples."""
        sums = self._sums.tolist()
        total_weight = sums[-2]
        out: dict[str, float] = {
            name: sums[i] / total_weight if total_weight > 0 else math.nan
            for i, name in enumerate(self.metric_names)
        }
        out["count"] = int(sums[-1])
        return out

    @property
    def confusion(self) -> Tensor:
        """Counts of real examples, [num_classes, num_classes] int64 on the CPU; rows are true
        labels, columns predictions."""
        if self.num_classes is None:
            raise ValueError("no confusion matrix: WeightedSums was built without num_classes")
        return self._confusion.cpu()


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval for a proportion of `successes` in `n` trials; (0, 1) when n == 0.
    Unlike the normal (Wald) interval it stays inside [0, 1] and is sensible at 0 or n successes."""
    if n < 0 or not 0 <= successes <= n:
        raise ValueError(f"wilson_interval needs 0 <= successes <= n, got {successes} of {n}")
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    # At 0 (or n) successes the bound is exactly 0 (or 1); rounding would leave it at ±1e-17.
    low = 0.0 if successes == 0 else max(0.0, center - half)
    high = 1.0 if successes == n else min(1.0, center + half)
    return low, high


def examples_for_change(n: int, delta: float) -> float:
    """How many examples a change of `delta` in a rate over `n` examples stands for: with a
    support of 27, +0.05 recall is 1.35 more examples found."""
    return n * delta


def per_class(confusion: Tensor | np.ndarray, z: float = Z_95) -> list[dict]:
    """One row per class of a confusion matrix (rows true labels, columns predictions): support,
    predicted count, true positives, precision and recall (NaN when undefined), their Wilson
    intervals, and the change in each rate that one example makes."""
    c = np.asarray(confusion.cpu() if isinstance(confusion, Tensor) else confusion, dtype=np.int64)
    if c.ndim != 2 or c.shape[0] != c.shape[1]:
        raise ValueError(f"confusion matrix must be square, got shape {c.shape}")
    rows = []
    for k in range(c.shape[0]):
        support, predicted, tp = int(c[k].sum()), int(c[:, k].sum()), int(c[k, k])
        rows.append(
            {
                "class": k,
                "support": support,
                "predicted": predicted,
                "true_positives": tp,
                "precision": tp / predicted if predicted else math.nan,
                "recall": tp / support if support else math.nan,
                "precision_interval": wilson_interval(tp, predicted, z),
                "recall_interval": wilson_interval(tp, support, z),
                # How far one example moves each rate: "+0.05 recall" is 0.05 / this examples.
                "precision_per_example": 1 / predicted if predicted else math.nan,
                "recall_per_example": 1 / support if support else math.nan,
            }
        )
    return rows
