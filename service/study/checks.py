"""Checks of a study against the world, before anything starts: the workload exists and knows
the metric and hyperparameters; the data files exist and have the workload's columns; the
storage is writable. Each failure is one line naming the field or file."""

from __future__ import annotations

import dataclasses
import sys
import uuid

import pyarrow.parquet as pq

from service.core import storage
from service.core.errors import DataError, SpecError, StorageError
from service.data.files import DataFile, check_column_types, check_declared_kinds, list_files
from service.study.search import OPTIMIZER_HPARAMS
from service.study.spec import Study


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
    from service import workloads  # torch: not for the coordinator, which needs `trial_footprint`

    workload = workloads.get(study.workload)
    check_declared_kinds(workload)
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
    entries = [(f"search.{k}", k) for k in study.search]
    entries += [(f"rounds[{i}].search.{k}", k) for i, r in enumerate(study.rounds) for k in r.search]
    for where, name in entries:
        if name not in accepted:
            raise SpecError(
                f"{where}: not a hyperparameter of the optimizer or of workload "
                f"{workload.name} (known: {', '.join(sorted(accepted))})"
            )


def check_data(study: Study) -> None:
    """Every file of every split has the workload's columns, of the kinds its `column_types`
    declares (so every value's type is checked) and of the same types as the split's first
    non-empty file, whose first rows the workload turns into a batch (footers only, and a few
    rows). A split needs rows; the training files must cover the hosts."""
    from service import workloads
    from service.data.preprocess import data_provenance

    workload = workloads.get(study.workload)
    files = {}
    for split in ("train", "validation", "test"):
        if getattr(study.data, split) is None:
            continue
        try:
            files[split] = _check_split(study, split, workload)
            if split == "train":  # its preprocess record, which a run copies: readable
                data_provenance(study.data.train)
        except (DataError, StorageError) as e:  # the field, then the file (relative: against the cwd)
            raise type(e)(f"data.{split}: {e}") from None
    check_overlap(study, workload, files)


def _check_split(study: Study, split: str, workload) -> list[DataFile]:
    """The split's files, listed once, after their checks."""
    uri = getattr(study.data, split)
    files = list_files(uri)
    _check_split_files(study, files, workload)
    if not sum(f.num_rows for f in files):
        raise DataError(f"{uri}: the {split} split has no rows")
    if split == "train" and len(files) < study.scaling.num_hosts:
        raise DataError(
            f"{uri}: {len(files)} training files cannot be sharded over scaling.num_hosts="
            f"{study.scaling.num_hosts}"
        )
    return files


def _check_split_files(study: Study, files, workload) -> None:
    """The columns of each of a split's files: present, of their declared kinds, and of the
    same types as in the split's first non-empty file (whose first rows are checked)."""
    reference = None
    for f in files:
        fs, path = storage.split(f.uri)
        with fs.open(path, "rb") as fh:
            pf = pq.ParquetFile(fh, pre_buffer=False)  # read on this thread: see files.ParquetReader
            names = pf.schema_arrow.names
            missing = [c for c in workload.columns if c not in names]
            if missing:
                raise DataError(
                    f"{f.uri}: missing column {missing[0]!r} needed by workload "
                    f"{workload.name} (has: {', '.join(names)})"
                )
            check_column_types(f.uri, pf.schema_arrow, workload)
            _check_id_nulls(f.uri, pf, workload)
            types = [pf.schema_arrow.field(c).type for c in workload.columns]
            if reference is None and f.num_rows:
                _check_first_row(study, f.uri, pf, workload)
                reference = (f.uri, types)
            elif reference is not None and types != reference[1]:
                c, t = next(
                    (c, t) for c, t, r in zip(workload.columns, types, reference[1], strict=True) if t != r
                )
                want = reference[1][list(workload.columns).index(c)]
                raise DataError(f"{f.uri}: column {c!r} is {t}, but {want} in {reference[0]}")


def _check_id_nulls(uri: str, pf: pq.ParquetFile, workload) -> None:
    """No null in the id column, by the null counts parquet writers record in each row group's
    footer statistics (a row group without them is left to the loader, which refuses the file)."""
    from service.data.window_reader import bad_ids

    meta = pf.metadata
    leaves = [j for j in range(meta.num_columns) if meta.schema.column(j).path == workload.id_column]
    if not leaves:
        return
    nulls = 0
    for g in range(meta.num_row_groups):
        stats = meta.row_group(g).column(leaves[0]).statistics
        if stats is not None and stats.has_null_count:
            nulls += stats.null_count
    if nulls:
        raise bad_ids(uri, workload, f"has {nulls} null(s)")


def check_overlap(study: Study, workload, files: dict[str, list[DataFile]]) -> None:
    """No example id of the training split is in the validation or test split (`data.overlap`:
    exact on small splits, estimated from a sample on large ones): refused, or with
    `data.allow_overlap` a warning with the count, either naming the field, then the split's
    path (`data.validation: <path>: ...`). `files`: each split's files, as listed."""
    from service.data import overlap

    train = overlap.read_ids(files["train"], workload.id_column)
    for split in ("validation", "test"):
        uri = getattr(study.data, split)
        if uri is None:
            continue
        found = overlap.overlap(train, overlap.read_ids(files[split], workload.id_column))
        if not found.count:
            continue
        message = f"data.{split}: {uri}: {found.describe(split, workload.id_column)}"
        if not study.data.allow_overlap:
            raise DataError(f"{message}; remove them, or set data.allow_overlap: true if intended")
        print(f"playbook: warning: {message} (data.allow_overlap: true)", file=sys.stderr, flush=True)


def _check_first_row(study: Study, uri: str, pf: pq.ParquetFile, workload) -> None:
    """The workload turns the file's first rows into a batch (right column types and shapes),
    their ids are integers, and the workload keeps its contract on them with the models this
    study's trials build (`contract.check_contract_as_studied`)."""
    from service.data.loader import example_ids
    from service.study.contract import check_contract_as_studied

    try:
        row = pf.read_row_group(0, columns=list(workload.columns), use_threads=False).slice(0, 4)
        workload.to_batch(row)
    except Exception as e:  # whatever the workload's conversion raises on a bad value
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"{uri}: not readable as workload {workload.name} input ({message})") from None
    example_ids(row, workload, uri)
    check_contract_as_studied(study, workload, row, uri)


def autoscaler_nodes(cluster_config, study: Study) -> list[dict]:
    """The nodes an autoscaling cluster can grow to, from the node groups its autoscaler
    reported (Ray's `ClusterConfig`: resources per node, max_count), in `ray.nodes()` form. A
    KubeRay cluster starts its GPU group at 0 replicas: judged by the nodes alive now, every GPU
    study would be refused. Ray Train checks its worker group against the same config."""
    if cluster_config is None:
        return []
    enough = study.scaling.world_size + 1  # more nodes of a group than this change nothing
    nodes = []
    for group in cluster_config.node_group_configs:
        count = enough if group.max_count < 0 else min(group.max_count, enough)
        nodes += [{"Alive": True, "Resources": dict(group.resources)}] * count
    return nodes


def trial_footprint(study: Study) -> dict[str, float]:
    """The CPUs and GPUs one running trial holds, all told: its workers' (the fast path's one
    worker is its Tune trial's process; a Ray Train trial's driver holds neither) and, with
    `input.workers: ray_data`, every worker's input actors. The pre-flight check
    (`check_resources`) and a round's concurrency count this."""
    s, inp = study.scaling, study.input
    input_cpus = inp.num_input_workers * inp.cpus_per_input_worker if inp.workers == "ray_data" else 0
    return {"CPU": s.world_size * (s.cpus_per_worker + input_cpus), "GPU": s.world_size if s.use_gpu else 0}


def check_resources(study: Study, nodes: list[dict], workers_field: str = "scaling.workers_per_host") -> None:
    """The cluster can place one trial with all it holds (`trial_footprint`: its
    workers, their Ray Data input workers; its own Tune process holds no CPU or GPU): `nodes` in
    `ray.nodes()` form (those alive now, or those an autoscaler can start, see
    `autoscaler_nodes`); refused before any trial starts, naming the field that asks too much
    (`workers_field` where the number of workers is too large: `playbook eval --num-workers`)."""
    s = study.scaling
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive")]
    gpus = sum(r.get("GPU", 0) for r in alive)
    if s.use_gpu and not gpus:
        raise SpecError("scaling.use_gpu: true, but the Ray cluster has no GPU")
    _check_cpus(study, alive, workers_field)
    if s.use_gpu and s.world_size > gpus:
        raise SpecError(f"{workers_field}: {s.world_size} GPU workers, but the Ray cluster has {gpus:g} GPUs")
    hosts = [r for r in alive if r.get("CPU", 0) >= s.cpus_per_worker and (not s.use_gpu or r.get("GPU", 0))]
    if s.num_hosts > len(hosts):
        raise SpecError(
            f"scaling.num_hosts: {s.num_hosts} hosts, but only {len(hosts)} node(s) of the Ray "
            "cluster can hold a worker"
        )


def _check_cpus(study: Study, alive: list[dict], workers_field: str) -> None:
    """One trial's CPUs fit: a worker on the largest node, all workers (and their Ray Data input
    workers) in the cluster."""
    s = study.scaling
    largest = max((r.get("CPU", 0) for r in alive), default=0)
    if s.cpus_per_worker > largest:
        raise SpecError(
            f"scaling.cpus_per_worker: {s.cpus_per_worker:g} CPUs per worker, but the largest "
            f"node of the Ray cluster has {largest:g}"
        )
    total = sum(r.get("CPU", 0) for r in alive)
    if s.world_size * s.cpus_per_worker > total:
        raise SpecError(
            f"{workers_field}: {s.num_hosts} x {s.workers_per_host} workers x "
            f"{s.cpus_per_worker:g} CPUs = {s.world_size * s.cpus_per_worker:g} CPUs, but the "
            f"Ray cluster has {total:g}"
        )
    need = trial_footprint(study)["CPU"]  # the workers' and their input actors' CPUs
    if need > total + 1e-9:
        inp = study.input
        raise SpecError(
            f"input.num_input_workers: {s.world_size} workers x ({s.cpus_per_worker:g} CPUs + "
            f"{inp.num_input_workers} Ray Data input workers x {inp.cpus_per_input_worker:g} CPUs) = "
            f"{need:g} CPUs, but the Ray cluster has {total:g}"
        )


def check_storage(study: Study) -> None:
    """Write and remove a probe file in the study folder; folders the probe created are
    removed again, so a refused study leaves no trace."""
    probe = study.layout.write_probe(uuid.uuid4().hex[:8])
    try:
        fs, path = storage.split(probe)
    except StorageError as e:
        raise StorageError(f"storage: {study.storage} is not usable ({e})") from None
    created = []
    parent = path.rsplit("/", 1)[0]
    try:
        while "/" in parent.strip("/") and not fs.exists(parent):
            created.append(parent)
            parent = parent.rsplit("/", 1)[0]
    except storage.storage_errors() as e:
        raise StorageError(f"storage: {study.storage} is not reachable ({storage.describe(e)})") from None
    try:
        storage.write_bytes_atomic(probe, b"ok")
        fs.rm(path)
    except (StorageError, *storage.storage_errors()) as e:
        raise StorageError(f"storage: {study.storage} is not writable ({storage.describe(e)})") from None
    finally:
        for folder in created:  # innermost first; only empty folders go
            try:
                fs.rmdir(folder)
            except storage.storage_errors():
                break
