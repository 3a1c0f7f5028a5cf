"""Data sets on disk: `playbook data` (a built-in data set as parquet shards) and `playbook
preprocess` (raw parquet into a workload's shards, offline)."""

from __future__ import annotations

import os

from service.data.make import DATASETS


def cmd_data(args) -> int:
    from service.core import storage
    from service.core.errors import DataError

    text_only = {"max_bytes": args.max_bytes, "seq_len": args.seq_len}
    options = {k: v for k, v in text_only.items() if v is not None}
    if options and args.dataset != "text":
        raise DataError(f"--{next(iter(options)).replace('_', '-')}: only `playbook data text` takes it")
    written = DATASETS[args.dataset](storage.absolute(args.uri), args.count, args.seed, **options)
    for split, files in written.items():
        print(f"{split}: {len(files)} files under {storage.join(storage.absolute(args.uri), split)}")
    return 0


def cmd_preprocess(args) -> int:
    from service import workloads
    from service.core import storage
    from service.data.preprocess import PROVENANCE_FILE, preprocess

    workloads.use_import_path([os.path.abspath(os.getcwd())])

    dest = storage.absolute(args.dest)
    record = preprocess(
        workloads.get(args.workload),
        storage.absolute(args.source),
        dest,
        num_files=args.num_files,
        row_group_size=args.row_group_size,
        seed=args.seed,
    )
    print(
        f"preprocessed {sum(f['num_rows'] for f in record['source_files'])} rows of "
        f"{len(record['source_files'])} files into {len(record['files'])} shards under {dest} "
        f"({record['num_rows']} rows; provenance: {storage.join(dest, PROVENANCE_FILE)})"
    )
    return 0
