"""Live progress lines: at most one per trial per interval (plus first and last), the ETA from
the reported rate, and the line's fields."""

from __future__ import annotations

from service.tracking.progress import ProgressLimiter, eta_s, format_duration, progress_line


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_at_most_one_line_per_trial_per_interval():
    clock = FakeClock()
    limiter = ProgressLimiter(10.0, clock)
    printed = []
    # two trials reporting every second for 35 s, 1 step per second, 100 steps
    for t in range(36):
        clock.now = float(t)
        for trial in ("a", "b"):
            if limiter.should_print(trial, t, 100):
                printed.append((trial, t))
    # independent expectation: first report, then every 10 s, per trial
    assert printed == [(trial, t) for t in (0, 10, 20, 30) for trial in ("a", "b")]
    clock.now = 31.0
    assert limiter.should_print("a", 100, 100)  # the last step is always printed
    assert not limiter.should_print("a", 99, 100)


def test_eta_and_line():
    assert eta_s(40, 100, 12.0) == 5.0
    assert eta_s(40, 100, None) is None and eta_s(40, 100, 0.0) is None
    assert [format_duration(s) for s in (5, 65, 3725, None)] == ["5s", "1m05s", "1h02m", "?"]
    result = {"step": 40, "train/loss": 0.5, "validation/loss": 0.25, "steps_per_s": 3.0}
    result |= {"best_metric": 0.25, "best_step": 40}
    line = progress_line("explore-0001", result, 100, "validation/loss")
    assert line.startswith("[explore-0001] step 40/100 (40%) ")
    for part in ("train/loss=0.5", "validation/loss=0.25", "best=0.25 at 40", "3 steps/s", "ETA 20s"):
        assert part in line
