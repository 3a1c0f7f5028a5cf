"""The playbook's reading of a batch-size probe (`playbook find-batch-size`).

The batch size is not a hyperparameter to tune for validation performance: it is chosen for
training speed, as the largest batch that still cuts the time per epoch (raises the examples
trained per second). While a batch's step is not yet using the hardware fully, doubling the
batch nearly doubles the examples/s (near-linear scaling); once it is, a doubling buys little
and only uses more memory. Changing the batch size afterwards means retuning most
hyperparameters, the learning rate and the regularisation above all.

As the code applies it: per-worker sizes are probed in doubling steps (powers of two) from the
smallest; a doubling "still speeds training" when examples/s rise by at least `MIN_GAIN`. The
probe stops at the first size that does not fit in memory or does not speed training, and the
chosen per-worker size is the last one reached through doublings that all paid. The global
batch size is that times the study's workers (num_hosts x workers_per_host)."""

from __future__ import annotations

from dataclasses import dataclass

from service.core.errors import SpecError
from service.core.formatting import cell
from service.study.spec import Study
from service.trainer.batch_probe import SizeResult

MIN_GAIN = 0.10
"""A doubling of the per-worker batch speeds training when examples/s rise by at least this
fraction (1.0 would be linear scaling)."""

MEMORY, NO_GAIN, AT_MAX = "does not fit", "stops scaling", "max reached"
"""Why the probe stopped."""


@dataclass(frozen=True)
class Reading:
    """The chosen per-worker size (None when none fits), why the probe stopped, the sentence."""

    per_worker_batch: int | None
    global_batch: int | None
    stopped: str
    message: str


def probe_sizes(smallest: int, largest: int, study: Study) -> list[int]:
    """The per-worker sizes to probe: powers of two from `smallest` to `largest`; with ghost
    batch norm only the multiples of `training.virtual_batch_size` (a single worker's batch
    must hold whole virtual batches)."""
    for flag, value in (("--min", smallest), ("--max", largest)):
        if value < 1 or value & (value - 1):
            raise SpecError(f"{flag}: must be a power of two (got {value})")
    if smallest > largest:
        raise SpecError(f"--min: must be <= --max ({smallest} > {largest})")
    sizes = [1 << k for k in range(smallest.bit_length() - 1, largest.bit_length())]
    tr = study.training
    if tr.ghost_batch_norm:
        sizes = [s for s in sizes if s % tr.virtual_batch_size == 0]
        if not sizes:
            raise SpecError(
                f"training.virtual_batch_size: {tr.virtual_batch_size} divides no power of two "
                f"from {smallest} to {largest} (ghost batch norm needs whole virtual batches)"
            )
    return sizes


def check_options(steps: int, min_gain: float | None) -> float:
    """The options' errors, before anything starts; returns the gain a doubling must give."""
    if steps < 1:
        raise SpecError(f"--steps: must be >= 1 (got {steps})")
    min_gain = MIN_GAIN if min_gain is None else min_gain
    if not 0 <= min_gain < 1:
        raise SpecError(f"--min-gain: must be in [0, 1) (got {min_gain})")
    return min_gain


def gain(before: SizeResult, after: SizeResult) -> float:
    """How much more examples/s `after` trains than `before` (0.1: 10% more)."""
    return after.examples_per_s / before.examples_per_s - 1.0


def walk(rows: list[SizeResult], min_gain: float = MIN_GAIN) -> tuple[int | None, str]:
    """(index of the chosen size or None, why the walk stopped): up from the smallest size,
    the last one reached through doublings that each gained at least `min_gain`."""
    chosen = None
    for i, row in enumerate(rows):
        if not row.fits:
            return chosen, MEMORY
        if chosen is not None and gain(rows[chosen], row) < min_gain:
            return chosen, NO_GAIN
        chosen = i
    return chosen, AT_MAX


def keeps_scaling(rows: list[SizeResult], min_gain: float = MIN_GAIN) -> bool:
    """Whether the probe goes on to the next size: every size so far fit and paid."""
    return walk(rows, min_gain)[1] == AT_MAX


def read(rows: list[SizeResult], study: Study, min_gain: float = MIN_GAIN) -> Reading:
    """The chosen size and the playbook's sentence about it."""
    chosen, stopped = walk(rows, min_gain)
    if chosen is None:
        first = rows[0]
        return Reading(
            None,
            None,
            stopped,
            f"no probed size fits: a per-worker batch of {first.per_worker_batch} does not fit in "
            f"memory ({first.error}); probe smaller sizes (--min), or make a step smaller "
            "(training.precision, a smaller model).",
        )
    size = rows[chosen].per_worker_batch
    world = study.scaling.world_size
    message = " ".join([why_chosen(rows, chosen, stopped, min_gain), global_sentence(size, study), RETUNE])
    return Reading(size, size * world, stopped, message)


def why_chosen(rows: list[SizeResult], chosen: int, stopped: str, min_gain: float) -> str:
    row = rows[chosen]
    scaling = ""
    if chosen > 0:
        per_doubling = (row.examples_per_s / rows[0].examples_per_s) ** (1 / chosen)
        scaling = (
            f" (examples/s x{per_doubling:.2f} per doubling from {rows[0].per_worker_batch}; "
            "x2 would be linear)"
        )
    head = f"per-worker batch size {row.per_worker_batch}: the largest that still speeds training{scaling}"
    if stopped == MEMORY:
        nxt = rows[chosen + 1]
        return f"{head}; {nxt.per_worker_batch} does not fit in memory ({nxt.error})."
    if stopped == NO_GAIN:
        nxt = rows[chosen + 1]
        return (
            f"{head}; {nxt.per_worker_batch} trains x{1 + gain(row, nxt):.2f} its examples/s, "
            f"below the x{1 + min_gain:.2f} a doubling must give."
        )
    return f"{head}, and still gaining at the largest size probed: rerun with a larger --max."


def global_sentence(size: int, study: Study) -> str:
    s, current = study.scaling, study.training.batch_size
    total = size * s.world_size
    same = "the study's already" if total == current else f"the study has {current}"
    return (
        f"Global batch size = {size} per worker x {s.world_size} worker(s) ({s.num_hosts} host(s) x "
        f"{s.workers_per_host} per host) = {total}: training.batch_size: {total} ({same})."
    )


RETUNE = (
    "The batch size is chosen for training speed, not tuned for validation performance; changing "
    "it means retuning most hyperparameters, the learning rate and the regularisation above all, "
    "so the search is rerun at the new training.batch_size."
)

COLUMNS = ("per-worker", "global", "examples/s", "x previous", "step ms", "peak memory", "input wait", "")


def table_rows(rows: list[SizeResult], study: Study, reading: Reading) -> list[list[str]]:
    """The table's cells, one list per probed size, the chosen one and the study's own marked."""
    world, current = study.scaling.world_size, study.training.batch_size // study.scaling.world_size
    out = []
    for i, r in enumerate(rows):
        ratio = None
        if i and r.fits and rows[i - 1].fits:
            ratio = f"x{1 + gain(rows[i - 1], r):.2f}"
        notes = [
            "chosen" if r.per_worker_batch == reading.per_worker_batch else "",
            "does not fit" if not r.fits else "",
            "study's" if r.per_worker_batch == current else "",
        ]
        out.append(
            [
                str(r.per_worker_batch),
                str(r.per_worker_batch * world),
                cell(None if r.examples_per_s is None else round(r.examples_per_s)),
                ratio or "-",
                cell(None if r.step_s is None else r.step_s * 1e3),
                mib(r.peak_memory_bytes),
                cell(r.input_wait_fraction),
                ", ".join(n for n in notes if n),
            ]
        )
    return out


def table_lines(rows: list[SizeResult], study: Study, reading: Reading) -> list[str]:
    """The probe's table as aligned text lines (what the command prints and writes)."""
    lines = [list(COLUMNS), *table_rows(rows, study, reading)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS))]
    return ["  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip() for line in lines]


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"
