"""A trial's status: where a trial is in its life, one name for each state.

The trial table's `status` column (and the studies table's counts, the Ray metrics, the report)
holds the value, upper case, as Tune names a trial's states. A trial's own reports and its
metrics log (`status` of each evaluation row and of its summary) hold the same states lower
case (`reported`): those files are read back by resumed trials and by `find-steps`, so their
spelling stays as it was written.
"""

from __future__ import annotations

from enum import StrEnum


class TrialStatus(StrEnum):
    PENDING = "PENDING"
    """Planned, in the table, not started."""
    RUNNING = "RUNNING"
    FINISHED = "FINISHED"
    """Trained its steps (its best evaluation is its result)."""
    DIVERGED = "DIVERGED"
    """Stopped at a non-finite loss; it has no result and is not run again."""
    FAILED = "FAILED"
    """Ended by an error (a data error, or Tune's retries used up); a rerun starts it again."""
    STOPPED = "STOPPED"
    """Was running when its study stopped (Ctrl-C, SIGTERM, an error that ended the study); a
    rerun resumes it from its latest checkpoint."""

    @property
    def reported(self) -> str:
        """The status as a trial's reports and metrics log spell it."""
        return self.value.lower()

    @classmethod
    def of_report(cls, reported: str) -> TrialStatus:
        """The status a trial's report or summary spells `reported` (lower case)."""
        return cls(reported.upper())


DONE = (TrialStatus.FINISHED, TrialStatus.DIVERGED)
"""A trial whose row has one of these is over; a rerun of the study does not start it again."""
