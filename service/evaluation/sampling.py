"""A fixed validation sample for periodic evals, and the full-set evals that check its bias.

Periodic evals on a sample are cheap; the sample is drawn once from the study seed (the same
examples at every eval and in every trial, so curves compare). At the end of training and every
`full_eval_every_steps`, the full set is evaluated too and the sample's gap to it is tested
against sampling noise (`bias.sample_gap`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from service.evaluation.bias import fixed_sample, sample_gap
from service.study.training import Training


@dataclass(frozen=True)
class EvalSample:
    positions: np.ndarray
    """Sorted positions of the sample over the whole split (file order)."""
    local_keep: torch.Tensor
    """The sample's positions inside this rank's contiguous shard."""


def plan_sample(total_rows: int, training: Training, world_rank: int, world_size: int) -> EvalSample | None:
    return sample_of(total_rows, training.validation_sample_size, training.seed, world_rank, world_size)


def sample_of(
    total_rows: int, size: int | None, seed: int, world_rank: int, world_size: int
) -> EvalSample | None:
    """A fixed sample of `size` of a split's rows and this rank's part of it (None: the whole
    split, when `size` is None or not smaller)."""
    if size is None or size >= total_rows:
        return None
    positions = fixed_sample(total_rows, size, seed)
    lo, hi = total_rows * world_rank // world_size, total_rows * (world_rank + 1) // world_size
    mine = positions[(positions >= lo) & (positions < hi)] - lo
    return EvalSample(positions, torch.from_numpy(mine.astype(np.int64)))


def is_full_eval(step: int, max_steps: int, training: Training) -> bool:
    every = training.full_eval_every_steps
    return step == max_steps or bool(every and step % every == 0)


def bias_fields(rows: dict[str, np.ndarray], sample: EvalSample, metric: str) -> dict:
    """The sample-vs-full gap of `metric` (a per-example metric name, weighted by the rows'
    `weight`, as the reported metric is) from a full eval's gathered rows, which are in file
    order (rank shards are contiguous and gathered in rank order)."""
    values, weights = rows[f"metric/{metric}"], rows["weight"]
    gap = sample_gap(
        values[sample.positions], values, sample_weights=weights[sample.positions], full_weights=weights
    )
    return {
        "sample_gap": gap["gap"],
        "sample_gap_ci_low": gap["ci_low"],
        "sample_gap_ci_high": gap["ci_high"],
        "sample_biased": bool(gap["biased"]),
    }
