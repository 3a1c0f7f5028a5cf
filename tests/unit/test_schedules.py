"""Learning-rate schedules: lr_factor at every step against an independently written piecewise formula."""

import math

import numpy as np
import pytest

from service.planning.schedules import lr_factor
from service.study.training import Schedule


def reference(kind: str, max_steps: int, warmup: int, decay_steps: int | None, final: float) -> np.ndarray:
    """The factor of every update 0..max_steps-1, built phase by phase: a linear ramp whose last
    warmup update is 1, then (linear) a constant phase and a decay phase of `decay_steps` updates,
    or (cosine) a half cosine over all post-warmup updates. The decay starts at 1 and reaches
    `final` at step max_steps, one step after the last update (no update is spent at lr 0)."""
    ramp = [(i + 1) / warmup for i in range(warmup)]
    rest = max_steps - warmup
    if kind == "constant":
        tail = [1.0] * rest
    elif kind == "cosine":
        tail = [final + (1 - final) * (1 + math.cos(math.pi * i / rest)) / 2 for i in range(rest)]
    else:
        d = decay_steps if decay_steps is not None else rest
        tail = [1.0] * (rest - d) + [1 - (1 - final) * i / d for i in range(d)]
    out = np.array(ramp + tail)
    assert out.shape == (max_steps,)
    return out


def factors(kind, max_steps, warmup, decay_steps=None, final=0.0) -> np.ndarray:
    sched = Schedule(kind=kind, warmup_steps=warmup, decay_steps=decay_steps, final_lr_fraction=final)
    return np.array([lr_factor(s, max_steps, sched) for s in range(max_steps)])


CASES = [
    # kind, max_steps, warmup, decay_steps, final
    ("constant", 50, 0, None, 0.0),
    ("constant", 50, 10, None, 0.0),
    ("linear", 60, 0, None, 0.0),
    ("linear", 60, 12, None, 0.0),
    ("linear", 60, 12, None, 0.25),
    ("linear", 100, 10, 30, 0.0),
    ("linear", 100, 10, 30, 0.1),
    ("linear", 100, 10, 90, 0.0),  # warmup + decay == max_steps: no constant phase
    ("linear", 100, 0, 1, 0.0),
    ("cosine", 80, 0, None, 0.0),
    ("cosine", 80, 16, None, 0.0),
    ("cosine", 300, 20, None, 0.05),
    ("cosine", 2, 1, None, 0.0),
]


@pytest.mark.parametrize("kind,max_steps,warmup,decay,final", CASES)
def test_every_step_matches_reference(kind, max_steps, warmup, decay, final):
    got = factors(kind, max_steps, warmup, decay, final)
    np.testing.assert_allclose(got, reference(kind, max_steps, warmup, decay, final), rtol=1e-12, atol=1e-12)
    assert np.all(got <= 1.0 + 1e-12)
    assert np.all(got[warmup:] >= final - 1e-12)
    assert np.all(got > 0)  # no update is spent at lr 0
    end = lr_factor(
        max_steps,
        max_steps,
        Schedule(kind=kind, warmup_steps=warmup, decay_steps=decay, final_lr_fraction=final),
    )
    assert end == pytest.approx(1.0 if kind == "constant" else final, abs=1e-12)


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_warmup_ramps_linearly_to_one_at_last_warmup_step(kind):
    warmup, max_steps = 8, 40
    got = factors(kind, max_steps, warmup)[:warmup]
    assert got[0] == pytest.approx(1 / warmup)  # the first update does not use lr 0
    assert got[warmup - 1] == pytest.approx(1.0)
    np.testing.assert_allclose(np.diff(got), np.full(warmup - 1, 1 / warmup), rtol=1e-12)


def test_constant_schedule_is_one_after_warmup():
    got = factors("constant", 30, 5)
    np.testing.assert_array_equal(got[5:], np.ones(25))


@pytest.mark.parametrize("final", [0.0, 0.1])
def test_cosine_is_monotone_and_ends_at_final_fraction(final):
    max_steps, warmup = 120, 20
    got = factors("cosine", max_steps, warmup, final=final)
    decay = got[warmup:]
    sched = Schedule(kind="cosine", warmup_steps=warmup, final_lr_fraction=final)
    assert lr_factor(max_steps, max_steps, sched) == pytest.approx(final, abs=1e-12)
    assert np.all(np.diff(decay) < 0)
    assert decay[0] == 1.0
    # Half way through the post-warmup steps the half cosine is at the midpoint of [final, 1].
    half = (max_steps - warmup) // 2
    assert decay[half] == pytest.approx((1 + final) / 2, abs=1e-12)


@pytest.mark.parametrize("final", [0.0, 0.2])
def test_linear_decay_lasts_exactly_decay_steps_after_a_constant_phase(final):
    max_steps, warmup, decay_steps = 200, 10, 50
    got = factors("linear", max_steps, warmup, decay_steps, final)
    constant, decay = got[warmup : max_steps - decay_steps], got[max_steps - decay_steps :]
    assert len(constant) == max_steps - warmup - decay_steps
    np.testing.assert_array_equal(constant, np.ones_like(constant))
    assert decay[0] == 1.0 and np.all(decay[1:] < 1.0)  # the decay starts from the base LR
    np.testing.assert_allclose(
        np.diff(decay), np.full(decay_steps - 1, -(1 - final) / decay_steps), rtol=1e-9
    )
    sched = Schedule(kind="linear", warmup_steps=warmup, decay_steps=decay_steps, final_lr_fraction=final)
    assert lr_factor(max_steps, max_steps, sched) == pytest.approx(final, abs=1e-12)


def test_linear_without_decay_steps_decays_over_all_post_warmup_steps():
    max_steps, warmup = 90, 15
    got = factors("linear", max_steps, warmup)
    post = got[warmup:]
    assert post[0] == 1.0 and np.all(post[1:] < 1.0)
    np.testing.assert_allclose(np.diff(post), np.full(len(post) - 1, -1 / (max_steps - warmup)), rtol=1e-9)
    assert post[-1] == pytest.approx(1 / (max_steps - warmup), abs=1e-12)


def test_round_override_shifts_the_decay_to_the_end_of_the_shorter_run():
    # Round 2 of the playbook keeps decay_steps and changes the total length.
    sched = Schedule(kind="linear", warmup_steps=5, decay_steps=20, final_lr_fraction=0.0)
    for max_steps in (40, 100):
        got = np.array([lr_factor(s, max_steps, sched) for s in range(max_steps)])
        np.testing.assert_allclose(got, reference("linear", max_steps, 5, 20, 0.0), rtol=1e-12, atol=1e-12)
        assert int(np.sum(got[5:] < 1.0)) == 19  # 20 decay updates, the first at the base LR
