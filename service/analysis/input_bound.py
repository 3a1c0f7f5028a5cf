"""Input-bound verdict: "diagnose input-bound pipelines ... prefetch, drop unused features as
early as possible, preprocess offline, keep data close" (the playbook's input-pipeline advice).

Every rank times how long each step waits for its batch (`input/wait_s`) against the whole
step (`input/step_s`); the loader times its own reads (`input/read_s`, parquet I/O and decode)
and the workload's online preprocessing (`input/preprocess_s`). The loop sums these over ranks
for each eval interval into the metrics log. The trial's `input/exposed_fraction` is the
total wait over the total step time; above the study's `input.input_bound_threshold` the trial
is input-bound, and the numbers name the likely cause and the remedy:

* unused columns read -> drop them from the workload's declared columns;
* the loader produces a batch faster than a step consumes it, yet steps wait -> the prefetch
  queue is too shallow for the loader's bursts (one window at a time): raise prefetch_batches;
* reading dominates -> remote I/O: cache the data on local disk or colocate it with the
  cluster (local storage: faster disk, fewer and larger row groups);
* preprocessing dominates -> heavy online preprocessing: move it offline with
  `playbook preprocess`; when the workload's `to_batch` decodes (it names a `decoded_workload`,
  e.g. `images` -> `images_decoded`), the verdict names decoding as the cost and the command
  that decodes once, offline, into that workload's columns;
* augmentation dominates (`input/augment_s`) -> it differs every epoch, so it cannot move
  offline: input worker processes;
* with input worker processes or Ray Data input workers (which read and preprocess off the
  rank) -> more input workers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from service.analysis.verdicts import OK, WARNING, Verdict, make_verdict

INPUT_ROW_FIELDS = ("input/exposed_fraction", "input/bound", "input/verdict")
"""The trial-table columns of this verdict."""
SUMS = ("input/wait_s", "input/step_s", "input/read_s", "input/preprocess_s", "input/augment_s")


@dataclass(frozen=True)
class InputTotals:
    """A trial's input timings summed over ranks and eval intervals (seconds)."""

    wait_s: float
    step_s: float
    read_s: float
    preprocess_s: float
    unused_columns: tuple[str, ...] = ()
    augment_s: float = 0.0

    @property
    def exposed_fraction(self) -> float:
        return self.wait_s / self.step_s if self.step_s > 0 else 0.0

    @classmethod
    def from_history(cls, history: Iterable[Mapping[str, Any]]) -> InputTotals | None:
        """Sum the metrics-log rows that carry input timings (None when none does)."""
        rows = [r for r in history if isinstance(r.get("input/step_s"), int | float)]
        if not rows:
            return None
        wait, step, read, pre, augment = [sum(float(r.get(k) or 0.0) for r in rows) for k in SUMS]
        unused = sorted({c for r in rows for c in (r.get("input/unused_columns") or "").split(",") if c})
        return cls(wait, step, read, pre, unused_columns=tuple(unused), augment_s=augment)


def input_bound(
    trial_name: str,
    totals: InputTotals,
    threshold: float,
    remote: bool,
    prefetch_batches: int,
    input_workers: str = "local",
    decoded_workload: str | None = None,
) -> Verdict:
    """OK below `threshold`; otherwise a warning naming the likely cause and its remedy
    (`decoded_workload`: the workload's, see `Workload.decoded_workload`)."""
    fraction = totals.exposed_fraction
    facts = {
        "exposed_fraction": fraction,
        "threshold": threshold,
        "wait_s": totals.wait_s,
        "step_s": totals.step_s,
        "read_s": totals.read_s,
        "preprocess_s": totals.preprocess_s,
        "augment_s": totals.augment_s,
    }
    share = f"{fraction:.0%} of its step time waiting for input"
    if fraction <= threshold:
        return make_verdict(
            "input_bound", trial_name, OK, f"{trial_name} spends {share}.", cause="none", **facts
        )
    cause, remedy = likely_cause(totals, remote, prefetch_batches, input_workers, decoded_workload)
    return make_verdict(
        "input_bound",
        trial_name,
        WARNING,
        f"{trial_name} is input-bound: it spends {share} (threshold {threshold:.0%}); likely cause: {remedy}",
        cause=cause,
        **facts,
    )


def likely_cause(
    totals: InputTotals,
    remote: bool,
    prefetch_batches: int,
    input_workers: str = "local",
    decoded_workload: str | None = None,
) -> tuple[str, str]:
    """(cause, sentence with the remedy), the most specific first. With input workers (processes
    or Ray Data) the reads and preprocessing happen in those workers, not on the rank (its read and
    preprocess times are ~0), so the rank's timings cannot tell them apart."""
    if totals.unused_columns:
        cols = ", ".join(totals.unused_columns)
        return "unused_columns", (
            f"columns the workload declares but never uses are read ({cols}): drop them from its columns."
        )
    if input_workers in ("processes", "ray_data"):
        offline = (
            f"decode the data once, offline, with `{decode_command(decoded_workload)}`"
            if decoded_workload
            else "move the workload's preprocessing offline with `playbook preprocess`"
        )
        return "input_workers", (
            "the input workers do not keep up with the steps: raise input.num_input_workers "
            f"(where the cores allow), {offline}, or keep the data closer to the cluster."
        )
    compute_s = totals.step_s - totals.wait_s
    produce_s = totals.read_s + totals.preprocess_s + totals.augment_s
    if produce_s < compute_s:
        return "prefetch_too_shallow", (
            f"the loader needs {produce_s:.3g} s for what the steps compute in {compute_s:.3g} s, "
            f"yet steps wait: prefetch is too shallow for its bursts; raise input.prefetch_batches "
            f"(now {prefetch_batches})."
        )
    if totals.read_s >= max(totals.preprocess_s, totals.augment_s):
        if remote:
            return "remote_io", (
                f"reading the data takes {totals.read_s:.3g} s (remote storage): cache it on local "
                "disk or colocate the data with the cluster."
            )
        return "slow_reads", (
            f"reading the data takes {totals.read_s:.3g} s: put it on faster disk, or write fewer, "
            "larger row groups."
        )
    if totals.augment_s > totals.preprocess_s:
        return "online_augmentation", (
            f"the workload's online augmentation takes {totals.augment_s:.3g} s: it differs every "
            "epoch, so it cannot move offline; run it in input worker processes (input.workers: processes)."
        )
    if decoded_workload:
        return "online_decoding", (
            f"decoding the data in the workload's online preprocessing takes {totals.preprocess_s:.3g} s "
            f"(augmentation {totals.augment_s:.3g} s): decode it once, offline, with "
            f"`{decode_command(decoded_workload)}` and train workload {decoded_workload} on DEST "
            "(augmentation stays online), or run it in input worker processes (input.workers: processes)."
        )
    return "online_preprocessing", (
        f"the workload's online preprocessing takes {totals.preprocess_s:.3g} s: move it offline "
        "with `playbook preprocess`, or run it in input worker processes (input.workers: processes)."
    )


def decode_command(decoded_workload: str) -> str:
    return f"playbook preprocess SRC DEST --workload {decoded_workload}"


def decoded_workload_of(name: str) -> str | None:
    """The study's workload's `decoded_workload` (None when it names none or cannot be loaded
    here)."""
    from service import workloads
    from service.core.errors import SpecError

    try:
        return workloads.get(name).decoded_workload
    except SpecError:
        return None


def is_remote(uri: str) -> bool:
    """Data behind a network (anything but local paths and memory://)."""
    return "://" in uri and uri.split("://", 1)[0] not in ("file", "local", "memory")


def trial_input_row(trial_name: str, history: Iterable[Mapping[str, Any]], study) -> dict:
    """The trial-table fields of a trial's metrics log: `input/exposed_fraction`,
    `input/bound` and `input/verdict` (the message); {} when the log has no input timings."""
    v = trial_input_verdict(trial_name, history, study)
    if v is None:
        return {}
    return dict(zip(INPUT_ROW_FIELDS, (v.facts["exposed_fraction"], v.is_warning, v.message), strict=True))


def trial_input_verdict(trial_name: str, history: Iterable[Mapping[str, Any]], study) -> Verdict | None:
    """The `input_bound` verdict of a trial's metrics log under the study's input settings
    (None when the log has no input timings)."""
    totals = InputTotals.from_history(history)
    if totals is None:
        return None
    return input_bound(
        trial_name,
        totals,
        study.input.input_bound_threshold,
        is_remote(study.data.train),
        study.input.prefetch_batches,
        study.input.workers,
        decoded_workload_of(study.workload),
    )


def row_verdicts(rows: Iterable[Mapping[str, Any]]) -> list[Verdict]:
    """The input-bound warnings recorded in trial rows (for the round's verdicts)."""
    return [
        make_verdict("input_bound", str(r["trial_name"]), WARNING, str(r["input/verdict"]))
        for r in rows
        if r.get("input/bound")
    ]
