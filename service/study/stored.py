"""The study stored under a study's name: reading it back (with the other studies' rounds it
builds on linked), and comparing a study file with it: a rerun resumes it, may add rounds after
its rounds (the study grows), and may change only the fields that decide how trials run."""

from __future__ import annotations

import dataclasses
import re

from service.core import storage
from service.core.errors import SpecError, StorageError
from service.study.spec import Study


def load_stored(study_uri: str) -> Study:
    """The study stored at `study_uri` (its study.yaml), with the rounds of other studies it
    builds on linked from the storage root that holds its folder."""
    from service.study import spec
    from service.study.layout import StudyLayout

    uri = StudyLayout(study_uri).study_file
    study = spec.load_text(storage.read_bytes(uri).decode(), source=uri)
    return link_rounds(study, root=study_uri.rstrip("/").rsplit("/", 1)[0])


def link_rounds(study: Study, root: str | None = None) -> Study:
    """The study with the other studies' rounds its `from_round: other-study/round` entries
    name (`Study.linked`), read from their study files under the same storage root (`root`,
    default its storage): each named as its reference, with the max_train_steps that study
    gives it. An unknown study or round is refused; the study is checked again with them
    (schedule lengths)."""
    from service.study import spec
    from service.study.layout import StudyLayout
    from service.study.search import Round

    linked, root = {}, root or study.storage
    for i, rnd in enumerate(study.rounds):
        if not rnd.from_other_study or rnd.from_round in linked:
            continue
        other_name, _, name = rnd.from_round.partition("/")
        uri = StudyLayout.of(root, other_name).study_file
        if not storage.exists(uri):
            raise SpecError(f"rounds[{i}].from_round: no study {other_name!r} under {root}")
        other = spec.load_text(storage.read_bytes(uri).decode(), uri)
        names = [r.name for r in other.rounds]
        if name not in names:
            known = ", ".join(names)
            raise SpecError(
                f"rounds[{i}].from_round: study {other_name} has no round {name!r} (its rounds: {known})"
            )
        # That round's length may rest on rounds before it (linked in turn); never on later ones,
        # so a chain of studies that refer to each other's later rounds ends.
        other = link_rounds(dataclasses.replace(other, rounds=other.rounds[: names.index(name) + 1]), root)
        source = other.rounds[-1]
        linked[rnd.from_round] = Round(
            name=rnd.from_round,
            num_trials=source.num_trials,
            kind=source.kind,
            max_train_steps=other.round_steps(source),
        )
    if not linked:
        return study
    study = dataclasses.replace(study, linked=tuple(linked.values()))
    for path, message in study.errors():
        raise SpecError(f"{path}: {message}")
    return study


def check_stored_study(study: Study) -> None:
    """A rerun resumes from the stored trial table: it must be readable."""
    uri = study.layout.trials_parquet
    if storage.exists(uri):
        from service.core.tables import read_parquet

        try:
            read_parquet(storage.read_bytes(uri))
        except Exception as e:
            raise StorageError(
                f"{uri}: the stored trial table is unreadable ({str(e).splitlines()[0]})"
            ) from None


# Fields that decide how a study's trials are run, not what they compute (the input workers
# and cache give the same batches bit for bit): a rerun may change them, e.g. to resume on a
# bigger cluster, and the coordinator stores the new study file.
RUN_ONLY_FIELDS = (
    "rounds[].max_concurrent_trials",
    "rounds[].trials_per_tune_run",
    "rounds[].reason",
    "input.prefetch_batches",
    "input.cache_mb",
    "input.workers",
    "input.num_input_workers",
    "input.cpus_per_input_worker",
    "input.sync_debug",
    "tracking.progress_interval_s",
    "scaling.collective_timeout_s",
)


def changed_fields(old, new, path: str = "") -> list[str]:
    """Dotted paths (`rounds[0].seed`) where two plain-data studies differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = list(old) + [k for k in new if k not in old]
        return [p for k in keys for p in changed_fields(old.get(k), new.get(k), f"{path}.{k}".lstrip("."))]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        pairs = enumerate(zip(old, new, strict=True))
        return [p for i, (a, b) in pairs for p in changed_fields(a, b, f"{path}[{i}]")]
    return [] if old == new else [path]


def _run_only(path: str) -> bool:
    return re.sub(r"\[\d+\]", "[]", path) in RUN_ONLY_FIELDS


def changed_from_stored(study: Study) -> tuple[Study, list[str]] | None:
    """The stored study of `study`'s name and storage (None when there is none) and the fields
    in which `study` differs from it, run-only fields and rounds added after its rounds aside."""
    stored_uri = study.layout.study_file
    if not storage.exists(stored_uri):
        return None
    from service.study import spec

    try:
        text = storage.read_bytes(stored_uri).decode()
    except UnicodeDecodeError:
        raise SpecError(f"{stored_uri}: the stored study file is not UTF-8 text") from None
    stored = spec.load_text(text, source=stored_uri)
    check_stored_study(study)
    old, new = spec.to_dict(stored), spec.to_dict(study)
    kept = new["rounds"][: len(old["rounds"])]
    return stored, [p for p in changed_fields(old, {**new, "rounds": kept}) if not _run_only(p)]


def check_same_study(study: Study) -> None:
    """A rerun resumes the stored study; a *different* study under the same name and storage
    would silently mix with it, so it is refused. Only `RUN_ONLY_FIELDS` may change, and new
    rounds may be added after the stored ones (the rerun runs them: the study grows)."""
    found = changed_from_stored(study)
    if found is None:
        return
    stored, changed = found
    if changed:
        rounds = ", ".join(r.name for r in stored.rounds)
        raise SpecError(
            f"name: study {study.name!r} already exists at {study.study_uri} with a "
            f"different {', '.join(changed)}; rerun it unchanged to resume, add rounds after "
            f"its rounds ({rounds}) to grow it, or give the new study another name"
        )
