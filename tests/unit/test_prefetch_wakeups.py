"""The prefetch thread is woken when there is room for its next run, not on every item served:
each needless wake-up is a switch to the thread and back inside the training step."""

from __future__ import annotations

import threading
import time

from service.data.prefetch import Prefetcher


def count_waits_of_prefetch_thread(runs: list[list[int]], depth: int) -> tuple[list[int], int]:
    """Serve every item of `runs`; returns the items and how many times the prefetch thread
    called Condition.wait (counted with the interpreter's own per-thread profile hook)."""
    waits = []

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "wait" and "threading" in frame.f_code.co_filename:
            if threading.current_thread().name == "playbook-prefetch":
                waits.append(1)

    threading.setprofile(hook)
    try:
        prefetcher = Prefetcher(iter(runs), depth)
    finally:
        threading.setprofile(None)
    items = []
    for item in prefetcher:  # a consumer that, like a training step, lets the thread run
        items.append(item)
        time.sleep(0.0005)
    prefetcher.close()
    return items, len(waits)


def test_the_thread_waits_about_once_per_run_not_once_per_item():
    runs = [list(range(i * 25, (i + 1) * 25)) for i in range(4)]  # 4 runs of 25 items
    items, waits = count_waits_of_prefetch_thread(runs, depth=2)
    assert items == list(range(100))
    # A wait per run (room for the next one) and a few spurious ones at most; the old wake-up
    # on every item served made the thread wait again after each of the 100 items.
    assert waits <= 2 * len(runs) + 2, waits
