"""bench/tune_memory's growth per trial, on hand-made memory series (no Ray)."""

from bench.tune_memory import PER_RUN, TRIALS, growth_per_trial, held_at, is_read, least_squares_growth

SIZES = list(range(30, 721, 30))
MB = 2**20


def test_a_steady_growth_is_its_slope():
    held = [200 * MB + 100 * 1024 * n for n in SIZES]
    assert growth_per_trial(SIZES, held) == 100 * 1024


def test_one_step_early_in_the_second_half_is_not_growth_per_trial():
    # Flat, but for one 16 MB step after trial 390 (the allocators reaching their high-water
    # mark): Theil-Sen reads 0; the least-squares slope reads tens of KB per trial.
    held = [(260 + (16 if n > 390 else 0)) * MB for n in SIZES]
    assert growth_per_trial(SIZES, held) == 0
    assert least_squares_growth(SIZES, held) > 20 * 1024


def test_steps_that_recur_are_growth():
    # 9 MB every 90 trials: 100 KB per trial on average, whatever the fit.
    held = [(260 + 9 * (n // 90)) * MB for n in SIZES]
    assert 80 * 1024 < growth_per_trial(SIZES, held) < 120 * 1024


def test_the_samples_held_at_reads_are_the_ones_taken_after_a_collection():
    # A sample's value is its trial count: held_at's medians show which samples it read.
    samples = [(done, done) for done in range(1, TRIALS + 1)]
    read = {done for done in range(1, TRIALS + 1) if is_read(done)}
    sizes = list(range(PER_RUN, TRIALS + 1, PER_RUN))
    assert held_at(samples, sizes) == [n - 2 for n in sizes]  # the median of n-4 .. n
    assert read == {n - k for n in sizes for k in range(5)}
