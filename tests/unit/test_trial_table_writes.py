"""The trial table's writes while a study runs (no Ray cluster): coalesced so that recording N
trials through the coordinator's Tune events rewrites O(N) rows in all (not one whole-table
rewrite per event, O(N^2)), a change inside the wait is written when it ends, writes take at
most their share of the time, and a flush leaves every row on storage."""

from __future__ import annotations

import threading

import pyarrow.parquet as pq

from service.orchestration.study_metrics import StudyMetrics
from service.tracking import trial_table
from service.tracking.coalesce import Coalesced
from service.tracking.trial_events import TrialEvents


class FakeTimer:
    def __init__(self, due_s: float, fn):
        self.due_s, self.fn, self.cancelled, self.daemon = due_s, fn, False, False

    def start(self) -> None:
        pass

    def cancel(self) -> None:
        self.cancelled = True


class FakeTime:
    """A clock and the timers due on it; `advance` fires the timers that fall due."""

    def __init__(self):
        self.now = 0.0
        self.timers: list[FakeTimer] = []

    def __call__(self) -> float:
        return self.now

    def timer(self, delay_s: float, fn) -> FakeTimer:
        t = FakeTimer(self.now + delay_s, fn)
        self.timers.append(t)
        return t

    def advance(self, seconds: float) -> None:
        self.now += seconds
        for t in [t for t in self.timers if t.due_s <= self.now and not t.cancelled]:
            self.timers.remove(t)
            t.fn()


def coalesced(fake: FakeTime, write, **kw) -> Coalesced:
    c = Coalesced(write, clock=fake, **kw)
    c.Timer = fake.timer
    return c


def test_recording_n_trials_rewrites_a_linear_number_of_rows(tmp_path, capsys):
    fake = FakeTime()
    written = []  # rows in each whole-table write

    def on_save(rows):
        written.append(len(rows))
        fake.now += 20e-6 * len(rows)  # a write costs time in proportion to the rows

    table = trial_table.TrialTable(str(tmp_path / "study"), "validation/loss", "min", on_save, clock=fake)
    table.writes.Timer = fake.timer
    events = TrialEvents(table, None, "validation/loss")
    n = 2000
    summary = {"summary": True, "status": "finished", "last_step": 10, "validation/loss": 0.5, "best_step": 5}
    for i in range(n):
        trial = {"trial_name": f"r-{i:04d}", "max_train_steps": 10}
        result = {"step": 10, "validation/loss": 1.0 / (i + 1)}
        table.update(f"r-{i:04d}", round="r", status="PENDING", max_train_steps=10)
        events.started(trial)
        fake.advance(0.001)  # the next Tune event a millisecond later
        for r in (result, summary):
            events.result(trial, r)
            fake.advance(0.001)
        events.complete(trial)
        fake.advance(0.001)
    capsys.readouterr()  # the progress lines
    # One write per trial event would rewrite 1 + 2 + ... + n rows (about n^2 / 2 = 2,000,000).
    # Coalesced: at most one write a second over the ~8 s of events, each at most n rows.
    assert 1 < len(written) <= 20
    assert sum(written) <= 20 * n
    table.save()  # the coordinator's write at the end of the round
    rows = pq.read_table(table.parquet_uri).to_pylist()
    assert len(rows) == n and {r["status"] for r in rows} == {"FINISHED"}
    assert not [t for t in fake.timers if not t.cancelled]


def test_a_change_within_the_wait_is_written_when_the_wait_ends():
    fake, writes = FakeTime(), []
    c = coalesced(fake, lambda: writes.append(fake.now), min_interval_s=1.0)
    c.request()
    assert writes == [0.0]  # the first change is written at once
    fake.advance(0.25)
    c.request()
    fake.advance(0.25)
    c.request()  # folded into the same deferred write
    assert writes == [0.0]
    fake.advance(0.5)  # one second after the first write
    assert writes == [0.0, 1.0]
    fake.advance(5.0)
    assert writes == [0.0, 1.0]  # nothing changed since: nothing written


def test_writes_take_at_most_their_share_of_the_time():
    fake, spans = FakeTime(), []

    def slow_write():
        start = fake.now
        fake.now += 0.5
        spans.append((start, fake.now))

    c = coalesced(fake, slow_write, share=0.1, min_interval_s=0.0)
    for _ in range(1000):  # a change every 0.1 s for 100 s
        c.request()
        fake.advance(0.1)
    busy = sum(end - start for start, end in spans)
    assert busy <= 0.1 * fake.now + 0.5
    gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:], strict=False)]
    assert min(gaps) >= 9 * 0.5 - 1e-9  # 9x the write's duration between writes at share 0.1


def test_flush_writes_now_and_cancels_the_deferred_write():
    fake, writes = FakeTime(), []
    c = coalesced(fake, lambda: writes.append(fake.now))
    c.request()
    fake.advance(0.1)
    c.request()
    (timer,) = fake.timers
    c.flush()
    assert writes == [0.0, 0.1] and timer.cancelled
    fake.advance(10.0)
    assert writes == [0.0, 0.1]


def test_a_failed_write_is_retried_by_the_next_request():
    fake, calls = FakeTime(), []

    def write():
        calls.append(fake.now)
        if len(calls) == 1:
            raise OSError("storage down")

    c = coalesced(fake, write, min_interval_s=1.0)
    try:
        c.request()
    except OSError:
        pass
    fake.advance(1.0)  # the retry is scheduled after the wait
    assert calls == [0.0, 1.0]


def test_the_deferred_write_runs_on_a_real_timer_thread():
    done = threading.Event()
    count = []

    def write():
        count.append(1)
        if len(count) == 2:
            done.set()

    c = Coalesced(write, min_interval_s=0.05)
    c.request()
    c.request()
    assert len(count) == 1
    assert done.wait(5.0)


def held_beyond_rows(study, n: int) -> int:
    """Bytes (tracemalloc) that the coordinator's event handling holds after recording n
    trials, beyond its trial table: what `TrialEvents` and its observers (progress limiter,
    metrics, study index, coalesced compiles) keep, measured as what deleting them frees."""
    import contextlib
    import gc
    import io
    import tracemalloc

    from service.tracking import observe

    tracemalloc.start()
    observers = observe.StudyObservers.for_study(study, StudyMetrics(study.name, study.training.mode))
    table = trial_table.TrialTable(study.study_uri, "validation/loss", "min", observers.rows_changed)
    events = TrialEvents(table, observers, "validation/loss")
    with contextlib.redirect_stdout(io.StringIO()):
        for i in range(n):
            trial = {"trial_name": f"explore-{i:05d}", "max_train_steps": 10}
            table.update(trial["trial_name"], round="explore", status="PENDING", max_train_steps=10)
            events.started(trial)
            events.result(trial, {"step": 5, "validation/loss": 0.9, "steps_per_s": 50.0})
            events.result(trial, {"step": 10, "validation/loss": 0.5, "steps_per_s": 50.0})
            summary = {"summary": True, "status": "finished", "last_step": 10, "best_step": 10}
            events.result(trial, {**summary, "validation/loss": 0.5, "best_checkpoint": f"/c/{i}"})
            events.complete(trial)
    table.save()
    observers.compiles.flush()
    observers.metrics.stop()
    gc.collect()
    with_events = tracemalloc.get_traced_memory()[0]
    table.on_save = None
    del events, observers
    gc.collect()
    held = with_events - tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert len(table.rows) == n
    return held


def test_the_coordinator_holds_nothing_per_trial_beyond_its_rows(tmp_path, digits_dir):
    """Tune's events reach the coordinator through `TrialEvents`; once a trial is over,
    nothing of it may stay there but its row (the issue's goal: memory flat per trial beyond
    the rows). What the events' handlers hold is the same after 200 trials and after 1,200."""
    from tests.helpers.studies import make_study

    study = make_study(digits_dir, tmp_path / "root", name="held")
    small, large = held_beyond_rows(study, 200), held_beyond_rows(study, 1200)
    assert large - small < 1000 * 8, (small, large)  # < 8 bytes per trial
