"""Quasi-random search: scrambled Halton points mapped onto the search space.

The playbook recommends quasi-random search for exploration rounds: it covers the space more
evenly than random search, is non-adaptive (trials can run in any order, in parallel) and a
prefix of the sequence is itself a good design, so adding trials later keeps the first ones.
"""

from __future__ import annotations

import math

import numpy as np

from service.spec import HParam, Scalar

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
    if hp.type == "choice":
        return hp.values[min(int(u * len(hp.values)), len(hp.values) - 1)]
    lo, hi = float(hp.min), float(hp.max)
    if hp.type == "int":
        if hp.scale == "log":  # log-uniform over the integer bins [k, k + 1)
            x = math.exp(math.log(lo) + u * (math.log(hi + 1) - math.log(lo)))
            return int(min(math.floor(x), hi))
        return int(min(math.floor(lo + u * (hi - lo + 1)), hi))
    if hp.scale == "log":
        return math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))
    return lo + u * (hi - lo)


def quasi_random_configs(space: dict[str, HParam], num_trials: int, seed: int) -> list[dict]:
    """`num_trials` hyperparameter dicts over the searched dimensions of `space` (fixed ones are
    added unchanged)."""
    searched = [(k, v) for k, v in space.items() if v.searched]
    points = scrambled_halton(num_trials, len(searched), seed)
    fixed = {k: v.value for k, v in space.items() if not v.searched}
    configs = []
    for row in points:
        config = {k: to_value(float(u), hp) for u, (k, hp) in zip(row, searched, strict=True)}
        configs.append({**config, **fixed})
    return configs
