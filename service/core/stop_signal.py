"""SIGTERM (`ray job stop`, a supervisor's stop) handled as SIGINT (Ctrl-C) is: it raises
KeyboardInterrupt in the command's main thread, and is remembered, so that the command can say
which of the two stopped it. Ray's blocking calls turn only a KeyboardInterrupt (or SystemExit)
raised by a signal handler into their own; Ray's own SIGTERM handlers, which this replaces,
exited at once, the C++ one printing a crash report."""

from __future__ import annotations

import signal
import threading

_sigterm = threading.Event()


def raise_on_sigterm() -> None:
    """From now on SIGTERM raises KeyboardInterrupt in the main thread (when called there)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum, frame):
        _sigterm.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def by_sigterm() -> bool:
    """Whether a KeyboardInterrupt came from SIGTERM (`raise_on_sigterm`) rather than SIGINT."""
    return _sigterm.is_set()
