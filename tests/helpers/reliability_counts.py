"""Counts for the reliability summary in docs/reliability.md, taken from the test files by
pytest's own collection: `python -m tests.helpers.reliability_counts` prints the summary lines; with
`--write` it rewrites them in docs/reliability.md (the generated block between the markers)."""

from __future__ import annotations

import collections
import os
import subprocess
import sys

DOC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "reliability.md")
BEGIN, END = "<!-- reliability-counts:begin -->", "<!-- reliability-counts:end -->"

FAULT_TESTS = {
    "training worker SIGKILLed mid-run": "tests/faults/test_fault_worker_kill.py",
    "single-worker (fast path) trial process SIGKILLed mid-run": "tests/faults/test_fault_trial_kill.py",
    "a rank of a multi-worker trial with reused workers (a pool actor, the trial's own process) "
    "SIGKILLed mid-run": "tests/faults/test_fault_pool_worker_kill.py",
    "a rank of an FSDP trial SIGKILLed mid-run: resumed from its sharded checkpoint": (
        "tests/faults/test_fault_fsdp_worker_kill.py"
    ),
    "a sharded checkpoint with a shard missing, truncated or damaged: refused by every rank": (
        "tests/multiprocess/test_fsdp_checkpoints.py::test_a_checkpoint_with_a_bad_shard_is_refused_naming_it"
    ),
    "an FSDP trial whose newest checkpoint lost a shard resumes from the one before": (
        "tests/multiprocess/test_fsdp_checkpoints.py::"
        "test_a_trial_whose_newest_checkpoint_lost_a_shard_resumes_from_the_one_before"
    ),
    "host removed from a 2-host trial, replacement added": "tests/cluster/test_fault_node_removed.py",
    "driver (`playbook run`) SIGKILLed mid-study and rerun, with a NaN trial in the study; the "
    "round's Tune run process SIGKILLed; a torn checkpoint, or Ray Train's torn record of them, on "
    "Ray storage": ("tests/faults/test_fault_driver_kill.py"),
    "a host's link down mid-trial (a partition) and back up, on hosts in network namespaces": (
        "tests/cluster/test_partition.py"
    ),
    "every process of a worker host SIGKILLed mid-trial, replacement added, on hosts in network namespaces": (
        "tests/cluster/test_real_hosts.py::test_a_killed_host_is_replaced_and_the_trial_resumes"
    ),
    "the same under fsdp, resumed from a sharded checkpoint": (
        "tests/cluster/test_real_hosts.py::test_a_killed_host_of_an_fsdp_trial_resumes_from_its_sharded_checkpoint"
    ),
    "a collective whose peer stopped answering times out": "tests/multiprocess/test_collective_timeout.py",
    "a superseded trial attempt's writes refused": "tests/unit/test_attempt_fence.py",
    "crash while a checkpoint is written / copied": "tests/faults/test_fault_checkpoint_commit.py",
    "storage errors (transient, persistent, permission denied, gcsfs 403/5xx, GCS emulator down "
    "mid-write)": "tests/faults/test_fault_storage.py",
    "a full disk during a checkpoint, a trial table write or training: one line, not retried, nothing "
    "half-written, the rerun resumes": ("tests/faults/test_full_disk.py"),
    "NaN loss (trainer level)": (
        "tests/multiprocess/test_trainer_loop.py::test_nan_loss_ends_trial_as_diverged"
    ),
    "preempted trial resumed (model, optimizer, schedule, RNG, data position)": (
        "tests/multiprocess/test_trainer_loop.py::test_resume_matches_uninterrupted_run"
    ),
    "resume uses each restored part (exact, then one part changed)": "tests/unit/test_resume_contract.py",
}
BAD_INPUT_TESTS = {
    "bad-input corpus through `playbook` (study file, workload, data, storage, resources, "
    "checkpoints; exit code 2, nothing written)": (
        "tests/faults/test_bad_input_corpus.py::test_bad_input_is_refused_cleanly"
    ),
    "study-file values through the spec loader": "tests/unit/test_spec.py",
}
SPEC_BAD = (
    "test_bad_value_names_dotted_path",
    "test_check_workload_names_the_field",
    "test_top_level_must_be_a_mapping",
    "test_non_finite_float_in_yaml",
    "test_cli_validate_reports_one_line_and_exits_2",
    "test_bad_linear_schedule",
    "test_round_override_must_leave_room_for_decay",
    "test_repeated_key_is_rejected_with_its_line",
    "test_malformed_yaml_names_source_and_line",
    "test_a_changed_study_under_an_existing_name_is_refused",
)


def collect(*targets: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *targets],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line for line in out.splitlines() if "::" in line]


def counts() -> dict[str, int]:
    ids = collect(*sorted({t.split("::")[0] for t in (*FAULT_TESTS.values(), *BAD_INPUT_TESTS.values())}))
    by_function = collections.Counter(i.split("[")[0] for i in ids)
    result = {}
    for label, target in {**FAULT_TESTS, **BAD_INPUT_TESTS}.items():
        if target == "tests/unit/test_spec.py":
            result[label] = sum(by_function[f"{target}::{f}"] for f in SPEC_BAD)
        elif "::" in target:
            result[label] = by_function[target]
        else:
            result[label] = sum(n for f, n in by_function.items() if f.startswith(target + "::"))
    return result


def summary_lines(c: dict[str, int]) -> list[str]:
    faults = sum(c[k] for k in FAULT_TESTS)
    bad = sum(c[k] for k in BAD_INPUT_TESTS)
    lines = [f"Fault-injection tests: {faults} (in `make test`, which CI runs on every change):"]
    lines += [f"- {label}: {c[label]}" for label in FAULT_TESTS]
    lines.append(f"Bad inputs tried: {bad}, each refused with one error line naming the field or file:")
    lines += [f"- {label}: {c[label]}" for label in BAD_INPUT_TESTS]
    return lines


def generated_block(text: str) -> str:
    """The summary lines of the doc's generated block (between the markers, inside its code fence)."""
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    return block.strip().removeprefix("```").removesuffix("```").strip("\n")


def rewrite_doc(path: str, lines: list[str], begin: str = BEGIN, end: str = END, fenced: bool = True) -> None:
    """Replace the block between the markers `begin` and `end` of `path` with `lines` (in a
    code fence when `fenced`)."""
    with open(path) as f:
        text = f.read()
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    body = "\n".join(lines) + "\n"
    with open(path, "w") as f:
        f.write(head + begin + "\n" + ("```\n" + body + "```\n" if fenced else body) + end + tail)


if __name__ == "__main__":
    summary = summary_lines(counts())
    if "--write" in sys.argv:
        rewrite_doc(DOC, summary)
    print("\n".join(summary))
