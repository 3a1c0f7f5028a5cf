"""The argument parser of `playbook`: every command, its options and the function that runs it,
in the order `playbook --help` lists them."""

from __future__ import annotations

import argparse

from service.cli.data import cmd_data, cmd_preprocess
from service.cli.next_round import cmd_next
from service.cli.probes import cmd_find_batch_size, cmd_find_steps
from service.cli.results import cmd_eval, cmd_export, cmd_report, cmd_status, cmd_studies
from service.cli.run import DEMO_STUDY, cmd_demo, cmd_run, cmd_validate
from service.data.make import DATASETS

DESCRIPTION = (
    "`playbook`: run | validate | next | status | report | studies | eval | export | find-steps |\n"
    "find-batch-size | data | preprocess | demo."
)

VERBOSE_HELP = "also show Ray's and Tune's own output (Tune's configuration boxes, Ray's INFO lines)"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="playbook", description=DESCRIPTION)
    sub = p.add_subparsers(required=True, metavar="COMMAND")
    add_study_commands(sub)
    add_result_commands(sub)
    add_probe_commands(sub)
    add_data_commands(sub)
    c = sub.add_parser("demo", help="write the digits data and run the demo study locally")
    c.add_argument("--study-file", default=DEMO_STUDY)
    c.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    c.set_defaults(func=cmd_demo)
    return p


def add_study_commands(sub) -> None:
    c = sub.add_parser("run", help="run a study on the Ray cluster in RAY_ADDRESS (or a local one)")
    c.add_argument("study_file")
    c.add_argument("--storage", help="override the study file's storage URI")
    c.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    c.add_argument(
        "--dry-run",
        action="store_true",
        help="make every check a run makes (study file, data, storage, cluster) and start nothing",
    )
    c.set_defaults(func=cmd_run)

    c = sub.add_parser("validate", help="check a study file; exit 2 with the bad field if wrong")
    c.add_argument("study_file")
    c.add_argument("--data", action="store_true", help="also check the data files")
    c.set_defaults(func=cmd_validate)

    c = sub.add_parser("next", help="the round a finished study's verdicts call for, as YAML to append")
    c.add_argument("study_file")
    c.add_argument("--append", action="store_true", help="write it into the study file (comments kept)")
    c.set_defaults(func=cmd_next)


def add_result_commands(sub) -> None:
    c = sub.add_parser("status", help="trial table of a running or finished study")
    c.add_argument(
        "study", help="a study file, a study URI (the folder holding its study.yaml), or a study name"
    )
    c.add_argument(
        "--storage", help="storage root of a study name (default: $PLAYBOOK_STORAGE or ./playbook-studies)"
    )
    c.set_defaults(func=cmd_status)

    c = sub.add_parser("report", help="write a study's HTML report and print it as a table")
    c.add_argument("study", help="a study file, or a study URI (the folder holding its study.yaml)")
    c.add_argument("--out", help="where to write the HTML (default: <study>/report.html)")
    c.set_defaults(func=cmd_report)

    c = sub.add_parser("studies", help="the storage root's tracking table: one row per study")
    c.add_argument("--storage", help="storage root URI (default: $PLAYBOOK_STORAGE or ./playbook-studies)")
    c.set_defaults(func=cmd_studies)

    c = sub.add_parser("eval", help="evaluate a saved checkpoint on a whole split, on the cluster")
    c.add_argument("checkpoint_uri")
    c.add_argument("--split", default="test", choices=["train", "validation", "test"])
    c.add_argument(
        "--num-workers", type=int, help="evaluate on this many workers (default: the study's layout)"
    )
    c.set_defaults(func=cmd_eval)

    c = sub.add_parser("export", help="a checkpoint's model as one file that plain PyTorch loads")
    c.add_argument("checkpoint_uri")
    c.add_argument("--out", required=True, help="the file to write (any storage URI)")
    c.add_argument("--format", default="torch", choices=["torch", "safetensors"])
    c.set_defaults(func=cmd_export)


def add_probe_commands(sub) -> None:
    c = sub.add_parser("find-steps", help="sweep constant learning rates to pick max_train_steps")
    c.add_argument("study_file")
    c.add_argument("--storage", help="override the study file's storage URI")
    c.set_defaults(func=cmd_find_steps)

    c = sub.add_parser("find-batch-size", help="probe per-worker batch sizes for the largest that pays")
    c.add_argument("study_file")
    c.add_argument("--min", type=int, default=8, help="smallest per-worker size, a power of 2 (default 8)")
    c.add_argument("--max", type=int, default=1024, help="largest per-worker size, power of 2 (default 1024)")
    c.add_argument("--steps", type=int, default=20, help="steps timed per block (default 20)")
    c.add_argument("--min-gain", type=float, help="fraction of examples/s a doubling must add (0.1)")
    c.add_argument("--out", help="the table's JSON (default: <study>/batch_size.json; .txt beside it)")
    c.set_defaults(func=cmd_find_batch_size)


def add_data_commands(sub) -> None:
    c = sub.add_parser("data", help="write a built-in dataset as parquet shards")
    c.add_argument("dataset", choices=sorted(DATASETS))
    c.add_argument("uri")
    c.add_argument("--count", type=int, help="number of examples (default: the data set's own)")
    c.add_argument("--seed", type=int, default=0, help="seed of everything drawn")
    c.add_argument("--max-bytes", type=int, help="text only: the corpus's size (default: all of it)")
    c.add_argument("--seq-len", type=int, help="text only: bytes per sequence (default 256)")
    c.set_defaults(func=cmd_data)

    c = sub.add_parser("preprocess", help="preprocess raw parquet offline into shards for a workload")
    c.add_argument("source", help="raw parquet files (a directory, glob or file; any fsspec URI)")
    c.add_argument("dest", help="where the shards and _provenance.json go")
    c.add_argument("--workload", required=True, help="built-in name or package.module:Class")
    c.add_argument("--num-files", type=int, default=8, help="shards (a multiple of the host count)")
    c.add_argument("--row-group-size", type=int, default=1024, help="rows per row group")
    c.add_argument("--seed", type=int, default=0, help="seed of the rows-to-shards assignment")
    c.set_defaults(func=cmd_preprocess)
