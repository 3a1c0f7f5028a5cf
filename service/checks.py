"""Checks of a study against the world, before anything starts: the workload exists and knows
the metric and hyperparameters; the data files exist and have the workload's columns; the
storage is writable. Each failure is one line naming the field or file."""

from __future__ import annotations

import dataclasses
import uuid

import pyarrow.parquet as pq

from service import storage, workloads
from service.data.files import list_files
from service.errors import DataError, SpecError, StorageError
from service.spec import OPTIMIZER_HPARAMS, Study


def resolve_paths(study: Study, storage_override: str | None = None) -> Study:
    """Relative local paths -> absolute (against the working directory)."""
    data = dataclasses.replace(
        study.data,
        train=storage.absolute(study.data.train),
        validation=storage.absolute(study.data.validation),
        test=storage.absolute(study.data.test) if study.data.test else None,
    )
    return dataclasses.replace(study, data=data, storage=storage.absolute(storage_override or study.storage))


def check_workload(study: Study) -> None:
    workload = workloads.get(study.workload)
    metric_name = study.training.metric.split("/", 1)[1]
    if not study.training.metric.startswith("validation/") or metric_name not in workload.metric_names:
        known = ", ".join(f"validation/{m}" for m in workload.metric_names)
        raise SpecError(
            f"training.metric: {study.training.metric!r} is not reported by workload "
            f"{workload.name} (known: {known})"
        )
    if study.training.ghost_batch_norm:
        from service.nn.ghost_batchnorm import has_batchnorm

        if not has_batchnorm(workload.build_model({})):
            raise SpecError(f"training.ghost_batch_norm: workload {workload.name} has no BatchNorm layer")
    accepted = set(OPTIMIZER_HPARAMS) | set(workload.hparam_defaults)
    for name in study.search:
        if name not in accepted:
            raise SpecError(
                f"search.{name}: not a hyperparameter of the optimizer or of workload "
                f"{workload.name} (known: {', '.join(sorted(accepted))})"
            )


def check_data(study: Study) -> None:
    workload = workloads.get(study.workload)
    for split in ("train", "validation"):
        files = list_files(getattr(study.data, split))
        for f in files:
            fs, path = storage.split(f.uri)
            with fs.open(path, "rb") as fh:
                names = pq.ParquetFile(fh).schema_arrow.names
            missing = [c for c in workload.columns if c not in names]
            if missing:
                raise DataError(
                    f"{f.uri}: missing column {missing[0]!r} needed by workload "
                    f"{workload.name} (has: {', '.join(names)})"
                )
        if split == "train" and len(files) < study.scaling.num_hosts:
            raise DataError(
                f"{study.data.train}: {len(files)} training files cannot be sharded "
                f"over scaling.num_hosts={study.scaling.num_hosts}"
            )


def check_storage(study: Study) -> None:
    probe = storage.join(study.study_uri, f".write-probe-{uuid.uuid4().hex[:8]}")
    try:
        storage.write_bytes_atomic(probe, b"ok")
        fs, path = storage.split(probe)
        fs.rm(path)
    except (StorageError, OSError) as e:
        raise StorageError(f"storage: {study.storage} is not writable ({e})") from None


def check_same_study(study: Study) -> None:
    """A rerun resumes the stored study; a *different* study under the same name and storage
    would silently mix with it, so it is refused."""
    stored_uri = storage.join(study.study_uri, "study.yaml")
    if not storage.exists(stored_uri):
        return
    from service import spec

    stored = spec.load_text(storage.read_bytes(stored_uri).decode(), source=stored_uri)
    if stored != study:
        changed = sorted(k for k, v in spec.to_dict(study).items() if spec.to_dict(stored).get(k) != v)
        raise SpecError(
            f"name: study {study.name!r} already exists at {study.study_uri} with a "
            f"different {', '.join(changed)}; rerun it unchanged to resume, or give "
            "the new study another name"
        )
