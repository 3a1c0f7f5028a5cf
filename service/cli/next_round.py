"""`playbook next STUDY.yaml [--append]`: the round the last round's verdicts call for
(`service.analysis.next_round`), printed as YAML to append to the study's `rounds:`, or with
`--append` written into the study file as text (every other byte kept) and read back."""

from __future__ import annotations

import os

from service.cli.prepare import load_study
from service.core.errors import SpecError, StudyNotFound
from service.study import spec
from service.study.spec import Study


def cmd_next(args) -> int:
    from service.analysis.next_round import as_yaml, propose
    from service.study.rounds_text import rounds_block
    from service.tracking import trial_table

    study = load_study(args.study_file)
    check_ran(study, args.study_file)
    last = study.rounds[-1].name
    rows = trial_table.read_rows(study.study_uri)
    proposal = propose(study, last, rows, round_findings(study, last, rows))
    with open(args.study_file, encoding="utf-8") as f:
        text = f.read()
    indent = rounds_block(text, args.study_file)[2] if args.append or proposal.fields else 2
    block = as_yaml(proposal, indent)
    if proposal.empty:
        print(block, end="")
        return 0
    try:
        new_text = appended(args.study_file, text, block)
    except SpecError as e:
        if args.append:
            raise SpecError(f"{args.study_file}: the proposed round is refused: {e}") from None
        print(f"{block}{' ' * indent}# note: as written, playbook validate refuses it: {e}")
        return 0
    if args.append:
        tmp = f"{args.study_file}.playbook-next.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(new_text)
        os.replace(tmp, args.study_file)
        print(f"appended round {proposal.fields[0].value} to {args.study_file}:")
    print(block, end="")
    return 0


def round_findings(study: Study, round_name: str, rows: list[dict]) -> list:
    """The round's verdicts as values with their data: those of `verdicts_for_round`, its
    training curves' (read from the trials' metrics logs) and each trial's input-bound verdict
    computed again from its log (the trial row keeps its message, not its cause)."""
    from service.analysis import curve_summary
    from service.analysis.input_bound import trial_input_verdict
    from service.analysis.round_checks import verdicts_for_round
    from service.trainer import metrics_log

    mine = [r for r in rows if r.get("round") == round_name]
    logs = {r["trial_name"]: metrics_log.read(study.layout.trial(r["trial_name"]).metrics_log) for r in mine}
    tr = study.training
    verdicts = verdicts_for_round(study, round_name, rows)
    verdicts += curve_summary.round_verdicts(mine, logs, tr.metric, tr.mode, study.curves)
    found = (trial_input_verdict(r["trial_name"], logs[r["trial_name"]], study) for r in mine)
    return verdicts + [v for v in found if v is not None]


def check_ran(study: Study, path: str) -> None:
    """Refused unless the study has run from this very file (its stored study.yaml is the
    file's study but for run-only fields) and its last round has verdicts."""

    from service.core import storage
    from service.study.stored import changed_from_stored

    layout = study.layout
    found = changed_from_stored(study)
    if found is None:
        raise StudyNotFound(
            f"{path}: study {study.name!r} has not run (no {layout.study_file}): run it first"
        )
    stored, changed = found
    ran = len(stored.rounds)
    if changed:
        raise SpecError(
            f"{path}: not the file study {study.name!r} ran (it differs from {layout.study_file} in "
            f"{', '.join(changed)})"
        )
    if len(study.rounds) > ran:
        rnd = study.rounds[ran]
        raise SpecError(
            f"rounds[{ran}]: round {rnd.name} has not run yet: run the study, then ask for the next"
        )
    done = storage.read_json(layout.verdicts, [])
    last = study.rounds[-1].name
    if not any(s.get("round") == last for s in done):
        raise StudyNotFound(
            f"{path}: round {last} of study {study.name!r} has no verdicts yet (not finished)"
        )


def appended(path: str, text: str, block: str) -> str:
    """The study file's `text` with `block` after its `rounds:` list, once it reads back as the
    file's study plus one round that `playbook validate` accepts (the budget too) and every
    byte outside the block is unchanged; SpecError otherwise."""
    from service.planning.plan_size import check_budget
    from service.study.rounds_text import append_round
    from service.study.strict import load_yaml

    new_text = append_round(text, block, path)
    old = spec.load_text(text, source=path)
    new = spec.load_text(new_text, source=path)  # SpecError (exit 2) if the round is refused
    old_raw, new_raw = spec.to_dict(old), spec.to_dict(new)
    if (
        new.rounds[:-1] != old.rounds
        or {**new_raw, "rounds": None} != {**old_raw, "rounds": None}
        or len(load_yaml(new_text, path)["rounds"]) != len(old.rounds) + 1
        or new_text.replace(block, "", 1).rstrip("\n") != text.rstrip("\n")
    ):
        raise SpecError(f"{path}: the appended round does not read back as one more round; append by hand")
    check_budget(new)
    return new_text
