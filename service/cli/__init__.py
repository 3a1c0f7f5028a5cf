"""The `playbook` command (`service.cli:main`, `python -m service`): `main` parses the command
line and runs one command, turning a PlaybookError into one line and its exit code.

parser.py  the argument parser: every command, its options and its function
run.py     running a study: run, validate, demo
live_table.py  what run shows while the study runs: its lines, a live table on a terminal
next_round.py  next: the round the last round's verdicts call for (and --append)
results.py what a study left: status, report, studies, eval (and the trial table they print)
probes.py  sweeps that pick a setting: find-steps, find-batch-size
data.py    data sets on disk: data, preprocess
prepare.py what a command does before it runs: load the study file, connect Ray, check the cluster
"""

from __future__ import annotations

import os
import sys

from service.cli.parser import parser
from service.core import stop_signal
from service.core.errors import PlaybookError, RunStopped


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        code = args.func(args) or 0
        sys.stdout.flush()  # a reader gone away is found here, not in the interpreter's exit
        return code
    except BrokenPipeError:
        return output_closed()
    except RunStopped as e:
        print(f"playbook: {e}", file=sys.stderr)
        return e.exit_code
    except PlaybookError as e:
        print(f"playbook: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        how, code = ("stopped by SIGTERM", 143) if stop_signal.by_sigterm() else ("interrupted", 130)
        print(f"playbook: {how}", file=sys.stderr)
        return code


def output_closed() -> int:
    """The reader of stdout went away (`playbook status ... | head`): exit 1 without a traceback,
    the Python docs' way: stdout onto /dev/null, so that the interpreter's own flush of what is
    still buffered fails no more at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 1
