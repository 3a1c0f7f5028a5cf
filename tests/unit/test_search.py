"""Quasi-random search: scrambled Halton point quality and the mapping onto each kind of hyperparameter."""

import math
from collections import Counter

import numpy as np
import pytest
from scipy import stats
from scipy.stats import qmc

from service.planning.search import quasi_random_configs, scrambled_halton, to_value
from service.study.search import HParam

FIRST_PRIMES = [2, 3, 5, 7, 11, 13]


def test_same_seed_gives_identical_points():
    np.testing.assert_array_equal(scrambled_halton(50, 4, seed=3), scrambled_halton(50, 4, seed=3))


def test_different_seed_gives_different_points_in_every_dimension():
    a, b = scrambled_halton(50, 4, seed=3), scrambled_halton(50, 4, seed=4)
    for d in range(4):
        assert not np.allclose(a[:, d], b[:, d])


def test_prefix_of_a_longer_sequence_is_the_shorter_sequence():
    long = scrambled_halton(300, 6, seed=11)
    for k in (1, 7, 64, 299):
        np.testing.assert_array_equal(scrambled_halton(k, 6, seed=11), long[:k])


def test_points_lie_in_unit_cube_and_are_distinct():
    pts = scrambled_halton(1000, 8, seed=0)
    assert pts.shape == (1000, 8)
    assert np.all(pts >= 0.0) and np.all(pts < 1.0)
    assert len(np.unique(pts, axis=0)) == 1000


def test_too_many_dimensions_is_an_error():
    with pytest.raises(ValueError):
        scrambled_halton(4, 31, seed=0)


@pytest.mark.parametrize("dim", range(len(FIRST_PRIMES)))
@pytest.mark.parametrize("seed", [0, 5])
def test_each_projection_puts_one_point_in_each_base_power_stratum(dim, seed):
    # Dimension d uses the d-th prime b: the first b^m points fill the b^m equal strata once each.
    base = FIRST_PRIMES[dim]
    n = base ** max(1, int(math.log(400) / math.log(base)))
    pts = scrambled_halton(n, len(FIRST_PRIMES), seed)[:, dim]
    counts, _ = np.histogram(pts, bins=n, range=(0.0, 1.0))
    np.testing.assert_array_equal(counts, np.ones(n, dtype=counts.dtype))


@pytest.mark.parametrize("n", [100, 256])
def test_each_projection_is_more_even_than_random(n):
    pts = scrambled_halton(n, 10, seed=1)
    for d in range(10):
        counts = np.bincount(np.floor(pts[:, d] * 10).astype(int), minlength=10)
        assert np.all(np.abs(counts - n / 10) <= 3), (d, counts)
        # sqrt(n) * KS distance to uniform: a random sample is below 0.45 only ~1% of the time.
        assert math.sqrt(n) * stats.kstest(pts[:, d], "uniform").statistic < 0.45


@pytest.mark.parametrize("n", [64, 256])
@pytest.mark.parametrize("dims", [3, 5])
def test_centered_discrepancy_beats_random_point_sets(n, dims):
    rng = np.random.default_rng(1234)
    random_cd = [qmc.discrepancy(rng.random((n, dims)), method="CD") for _ in range(20)]
    for seed in (0, 1):
        ours = qmc.discrepancy(scrambled_halton(n, dims, seed), method="CD")
        assert ours < np.median(random_cd)
        assert ours < min(random_cd)


# ----------------------------------------------------------------------------- mapping to values

N = 400
SPACE = {
    "learning_rate": HParam(role="nuisance", type="float", min=1e-4, max=1.0, scale="log"),
    "momentum": HParam(role="nuisance", type="float", min=0.5, max=0.99),
    "width": HParam(role="scientific", type="int", min=2.0, max=9.0),
    "depth": HParam(role="nuisance", type="int", min=1.0, max=1000.0, scale="log"),
    "optimizer": HParam(role="scientific", type="choice", values=("sgd", "adam", "nesterov")),
    "weight_decay": HParam(role="fixed", value=5e-4),
    "activation": HParam(role="fixed", value="relu"),
}
SEARCHED = ["learning_rate", "momentum", "width", "depth", "optimizer"]


@pytest.fixture(scope="module")
def configs():
    return quasi_random_configs(SPACE, N, seed=7)


def column(configs, name):
    return [c[name] for c in configs]


def test_configs_have_every_key_and_are_deterministic(configs):
    assert len(configs) == N
    assert all(set(c) == set(SPACE) for c in configs)
    assert quasi_random_configs(SPACE, N, seed=7) == configs
    assert quasi_random_configs(SPACE, N, seed=8) != configs
    assert quasi_random_configs(SPACE, 25, seed=7) == configs[:25]


def test_searched_values_follow_the_halton_coordinates(configs):
    u = scrambled_halton(N, len(SEARCHED), seed=7)  # one coordinate per searched dim, in space order
    lr = np.array(column(configs, "learning_rate"))
    np.testing.assert_allclose(lr, 10 ** (-4 + 4 * u[:, 0]), rtol=1e-9)
    np.testing.assert_allclose(column(configs, "momentum"), 0.5 + 0.49 * u[:, 1], rtol=1e-12)
    np.testing.assert_array_equal(column(configs, "width"), 2 + np.floor(u[:, 2] * 8))


def test_log_dimension_is_uniform_in_log_space(configs):
    lr = np.array(column(configs, "learning_rate"))
    assert np.all((lr >= 1e-4) & (lr <= 1.0))
    logs = np.log10(lr)
    assert stats.kstest(logs, stats.uniform(loc=-4, scale=4).cdf).statistic < 0.03
    decades = np.histogram(logs, bins=4, range=(-4, 0))[0] / N
    np.testing.assert_allclose(decades, 0.25, atol=0.02)
    # Uniform in linear space would put ~90% of the values above 0.1.
    assert stats.kstest(lr, stats.uniform(loc=1e-4, scale=1 - 1e-4).cdf).statistic > 0.5


def test_linear_dimension_is_uniform_in_linear_space(configs):
    m = np.array(column(configs, "momentum"))
    assert np.all((m >= 0.5) & (m <= 0.99))
    assert stats.kstest(m, stats.uniform(loc=0.5, scale=0.49).cdf).statistic < 0.03
    # A log-scaled draw over the same range would be visibly non-uniform in linear space.
    log_uniform = stats.uniform(loc=math.log(0.5), scale=math.log(0.99) - math.log(0.5))
    assert stats.kstest(np.log(m), log_uniform.cdf).statistic > 0.06
    assert np.mean(m) == pytest.approx((0.5 + 0.99) / 2, abs=0.005)


def test_int_dimension_is_integer_within_bounds_and_covers_all_values_evenly(configs):
    w = column(configs, "width")
    assert all(type(x) is int for x in w)
    assert min(w) == 2 and max(w) == 9
    counts = Counter(w)
    assert set(counts) == set(range(2, 10))
    assert all(abs(c - N / 8) <= 2 for c in counts.values())


def test_log_int_dimension_is_log_uniform_over_integer_bins(configs):
    d = np.array(column(configs, "depth"))
    assert all(type(x) is int for x in column(configs, "depth"))
    assert d.min() >= 1 and d.max() <= 1000
    # Log-uniform over [1, 1001): P(x < 10) = ln 10 / ln 1001, P(x < 100) = ln 100 / ln 1001.
    for cut in (10, 100):
        expected = math.log(cut) / math.log(1001)
        assert np.mean(d < cut) == pytest.approx(expected, abs=0.02)


def test_choice_dimension_covers_all_values_about_equally(configs):
    counts = Counter(column(configs, "optimizer"))
    assert set(counts) == {"sgd", "adam", "nesterov"}
    assert all(abs(c - N / 3) <= 2 for c in counts.values())


def test_fixed_hparams_pass_through_and_take_no_dimension(configs):
    assert all(c["weight_decay"] == 5e-4 and c["activation"] == "relu" for c in configs)
    searched_only = {k: v for k, v in SPACE.items() if v.searched}
    assert [{k: c[k] for k in SEARCHED} for c in configs] == quasi_random_configs(searched_only, N, seed=7)


def test_only_fixed_hparams_give_identical_configs():
    space = {"learning_rate": HParam(role="fixed", value=0.1), "width": HParam(role="fixed", value=16)}
    assert quasi_random_configs(space, 3, seed=0) == [{"learning_rate": 0.1, "width": 16}] * 3


@pytest.mark.parametrize("u", [0.0, float(np.nextafter(1.0, 0.0))])
def test_to_value_stays_in_bounds_at_the_ends_of_the_unit_interval(u):
    hi_end = u > 0.5
    assert to_value(u, HParam(role="nuisance", type="int", min=3.0, max=7.0)) == (7 if hi_end else 3)
    assert to_value(u, HParam(role="nuisance", type="int", min=1.0, max=50.0, scale="log")) == (
        50 if hi_end else 1
    )
    choice = HParam(role="nuisance", type="choice", values=(1, "b", True))
    assert to_value(u, choice) == (True if hi_end else 1)
    lr = to_value(u, HParam(role="nuisance", type="float", min=1e-3, max=10.0, scale="log"))
    assert 1e-3 * (1 - 1e-12) <= lr <= 10.0 * (1 + 1e-12)
    assert lr == pytest.approx(10.0 if hi_end else 1e-3, rel=1e-9)


def test_configs_are_each_points_coordinates_mapped_one_by_one(configs):
    # The configs map whole columns at once; the same points through to_value, one at a time.
    searched = [k for k, hp in SPACE.items() if hp.searched]
    points = scrambled_halton(N, len(searched), seed=7)
    for config, point in zip(configs, points, strict=True):
        for name, u in zip(searched, point, strict=True):
            assert config[name] == to_value(float(u), SPACE[name])
