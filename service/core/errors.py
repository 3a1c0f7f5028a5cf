"""Typed errors for bad input. The CLI turns each into one line on stderr and exit code 2."""

from __future__ import annotations

import errno
import os


class PlaybookError(Exception):
    """Base class: an error in what the user gave us (not a bug in the service)."""

    exit_code = 2


class SpecError(PlaybookError):
    """A study file is malformed; the message starts with the dotted path of the bad field."""


class DataError(PlaybookError):
    """A data file or URI is missing, empty, corrupt or does not match the workload's schema."""


class StorageError(PlaybookError):
    """The study storage cannot be read or written."""


class StorageFull(StorageError):
    """The study's storage has no space left (or its quota is used up): no retry helps until
    space is freed. A trial that meets it ends at once, and its study stops; the same command
    run again resumes from the last committed checkpoints. One line, exit code 1."""

    exit_code = 1

    ADVICE = "free space and run the same command again: it resumes from the last committed checkpoints"

    def advised(self) -> StorageFull:
        """This error with what to do about it, said once."""
        return self if self.ADVICE in str(self) else StorageFull(f"{self}; {self.ADVICE}")


FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


def storage_full(uri: str, error: BaseException) -> StorageFull | None:
    """`error` as a StorageFull naming `uri`, where it says that storage is full: an OSError of
    ENOSPC or EDQUOT, or a StorageError raised over one (`core.storage` keeps the OSError as its
    context); None otherwise."""
    if isinstance(error, StorageFull):
        return error
    cause = error.__context__ if isinstance(error, StorageError) else error
    if isinstance(cause, OSError) and cause.errno in FULL_ERRNOS:
        if isinstance(error, StorageError):
            return StorageFull(str(error))
        return StorageFull(f"{uri}: cannot write ({os.strerror(cause.errno)})")
    return None


class StudyStopped(PlaybookError):
    """A study cannot go on: a round has nothing to start from (every trial of the round it
    extends, repeats or narrows to failed or diverged). The study file was fine, so not exit
    code 2: one line, exit code 1, the rounds before it kept."""

    exit_code = 1


class StudyInterrupted(PlaybookError):
    """A process the study ran in died (its coordinator): the study stopped where it was, what
    it finished is kept on storage, and running the same command again resumes it. One line,
    exit code 1."""

    exit_code = 1


class RunStopped(PlaybookError):
    """`playbook run` stopped by its user (SIGINT, Ctrl-C) or by SIGTERM while the study ran: its
    trial table and index row are saved as they were (state `stopped`), and running the same
    command again resumes it. Not an error: one line without "error:", exit code 130 or 143 as
    a shell reports a process ended by that signal."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class StudyNotFound(PlaybookError):
    """No running coordinator and no stored study under that name."""


class CheckpointError(PlaybookError):
    """A checkpoint directory is incomplete (no manifest, or files that do not match it)."""
