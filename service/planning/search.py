"""Quasi-random search: scrambled Halton points mapped onto the search space.

The playbook recommends quasi-random search for exploration rounds: it covers the space more
evenly than random search, is non-adaptive (trials can run in any order, in parallel) and a
prefix of the sequence is itself a good design, so adding trials later keeps the first ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from service.study.search import HParam
from service.study.strict import Scalar

PRIMES = (
    2,
    3,
    5,
    7,
    11,
    13,
    17,
    19,
    23,
    29,
    31,
    37,
    41,
    43,
    47,
    53,
    59,
    61,
    67,
    71,
    73,
    79,
    83,
    89,
    97,
    101,
    103,
    107,
    109,
    113,
)


def scrambled_halton(num_points: int, num_dims: int, seed: int) -> np.ndarray:
    """Points in [0, 1)^num_dims. Digits are scrambled by one random permutation per
    (dimension, digit position), fixed by `seed`; the number of digits does not depend on
    `num_points`, so the first k points are the same whatever `num_points` is."""
    if num_dims > len(PRIMES):
        raise ValueError(f"at most {len(PRIMES)} searched dimensions are supported")
    rng = np.random.default_rng(seed)
    out = np.zeros((num_points, num_dims))
    for d in range(num_dims):
        base = PRIMES[d]
        num_digits = math.ceil(52 * math.log(2) / math.log(base))  # float64 resolution
        perms = np.stack([rng.permutation(base) for _ in range(num_digits)])
        index = np.arange(1, num_points + 1)  # index 0 would be the all-zero corner
        scale = 1.0 / base
        for k in range(num_digits):
            out[:, d] += perms[k][index % base] * scale
            index //= base
            scale /= base
    return out


def to_value(u: float, hp: HParam) -> Scalar:
    """Map a unit-interval coordinate onto one searched dimension."""
    return value_map(hp)(u)


def value_map(hp: HParam) -> Callable[[float], Scalar]:
    """`to_value` for one dimension as a function of the coordinate alone: the bounds'
    logarithms are taken once per dimension, not once per point (the same arithmetic, so the
    same values; 100,000 points are then mapped in a fraction of a second)."""
    if hp.type == "choice":
        values, last = hp.values, len(hp.values) - 1
        return lambda u: values[min(int(u * len(values)), last)]
    lo, hi = float(hp.min), float(hp.max)
    if hp.type == "int":
        if hp.scale == "log":  # log-uniform over the integer bins [k, k + 1)
            log_lo, log_span = math.log(lo), math.log(hi + 1) - math.log(lo)
            return lambda u: int(min(math.floor(math.exp(log_lo + u * log_span)), hi))
        return lambda u: int(min(math.floor(lo + u * (hi - lo + 1)), hi))
    if hp.scale == "log":
        log_lo, log_span = math.log(lo), math.log(hi) - math.log(lo)
        return lambda u: math.exp(log_lo + u * log_span)
    return lambda u: lo + u * (hi - lo)


def quasi_random_configs(space: dict[str, HParam], num_trials: int, seed: int) -> list[dict]:
    """`num_trials` hyperparameter dicts over the searched dimensions of `space` (fixed ones are
    added unchanged)."""
    searched = [(k, v) for k, v in space.items() if v.searched]
    points = scrambled_halton(num_trials, len(searched), seed)
    fixed = {k: v.value for k, v in space.items() if not v.searched}
    names = [k for k, _ in searched]
    # One dimension at a time (a list comprehension over a column), then the rows.
    columns = [list(map(value_map(hp), points[:, d].tolist())) for d, (_, hp) in enumerate(searched)]
    rows = zip(*columns, strict=True) if columns else [()] * num_trials
    return [{**dict(zip(names, row, strict=True)), **fixed} for row in rows]
