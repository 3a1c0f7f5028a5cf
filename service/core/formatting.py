"""One way to write a value for people to read: in log lines, verdict messages, the report and
the CLI's tables."""

from __future__ import annotations

import numbers
from typing import Any


def fmt(v: Any) -> str:
    """A real number with 4 significant digits (`nan`, `inf` as Python writes them), an integer
    as itself, anything else (a bool, a string, None) as str()."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return str(v)
    if isinstance(v, numbers.Integral):
        return str(int(v))
    return f"{float(v):.4g}"


def cell(v: Any) -> str:
    """A value as a table cell: `fmt`, and '-' for a missing value."""
    return "-" if v is None else fmt(v)


def trial_count(n: int) -> str:
    """`1 trial`, `3 trials`: `n` trials in words."""
    return f"{n} trial" if n == 1 else f"{n} trials"
