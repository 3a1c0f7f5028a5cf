"""The bad-input corpus's cases: each prepares one kind of bad input (study file, workload,
data, storage, resources, checkpoint) in a case folder and names the field or file the error
must start with. Run by tests/faults/test_bad_input_corpus.py."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from service.distributed import checkpoint
from service.distributed.checkpoint import TrialState
from tests.helpers.flaky_storage import FlakyMemoryFS, unwritable_dir


@dataclass
class Case:
    """One case's world: a folder with a study file, a copy of the digits data on request, and
    the storage root the study would write to."""

    root: str
    digits: str
    raw: dict
    study_file: str = ""
    needs_ray: bool = False

    @property
    def storage(self) -> str:
        return self.raw["storage"]

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def data_copy(self, split: str = "train") -> str:
        """A private copy of one split, pointed to by the study; returns its folder."""
        target = self.path("data", split)
        if not os.path.exists(target):
            shutil.copytree(os.path.join(self.digits, split), target)
        self.raw["data"][split] = target
        return target

    def set(self, dotted: str, value) -> None:
        node = self.raw
        *parents, last = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value


def first_file(folder: str) -> str:
    return os.path.join(folder, sorted(os.listdir(folder))[0])


def rewrite_table(path: str, change: Callable[[pa.Table], pa.Table]) -> None:
    pq.write_table(change(pq.read_table(path)), path)


def fake_checkpoint(c: Case, torn: Callable[[str], None]) -> str:
    """A checkpoint dir inside a stored study, then damaged by `torn`."""
    d = c.path("storage", "ck", "trials", "explore-0000", "checkpoint_0")
    checkpoint.save(TrialState(step=1, hparams={"width": 4}), d, {"step": 1})
    with open(c.path("storage", "ck", "study.yaml"), "w") as f:
        yaml.safe_dump(c.raw, f)
    torn(d)
    return d


# (id, command, prepare): prepare(case) edits the case's study / files and returns the
# (argv, expected start of the error after "playbook: error: "). {study} = the study file.
CASES: list[tuple[str, Callable[[Case], tuple[list[str], str]]]] = []


def case(name: str):
    def register(fn):
        CASES.append((name, fn))
        return fn

    return register


def run(c: Case) -> list[str]:
    return ["run", c.study_file]


def validate_data(c: Case) -> list[str]:
    return ["validate", "--data", c.study_file]


# --- the study file itself (value errors: tests/unit/test_spec.py) ---------------------------------
@case("study-file-missing")
def _(c):
    c.study_file = c.path("nope.yaml")
    return run(c), c.study_file


@case("study-file-is-a-directory")
def _(c):
    c.study_file = c.path("adir.yaml")
    os.makedirs(c.study_file)
    return run(c), c.study_file


@case("study-file-empty")
def _(c):
    c.raw = None
    return run(c), "{study}"


@case("study-file-malformed-yaml-on-run")
def _(c):
    c.raw = "name: x\ntraining: {max_train_steps: 10\n"
    return run(c), "{study}"


@case("study-file-python-tag")
def _(c):  # YAML is safe-loaded: the tag is refused and the command never runs
    c.raw = f"name: !!python/object/apply:os.system ['touch {c.path('pwned')}']\n"
    return run(c), "{study}"


@case("study-file-unknown-key-on-run")
def _(c):
    c.raw["trainig"] = {}
    return run(c), "trainig"


@case("study-file-wrong-type-on-run")
def _(c):
    c.set("training.batch_size", "32")
    return run(c), "training.batch_size"


@case("study-file-impossible-range-on-run")
def _(c):
    c.raw["search"]["learning_rate"].update(min=0.5, max=0.01)
    return run(c), "search.learning_rate"


@case("study-file-learning-rate-beyond-float32-on-run")
def _(c):
    c.raw["search"]["learning_rate"] = {"role": "fixed", "value": 1e300}
    return run(c), "search.learning_rate"


@case("study-file-negative-num-hosts")
def _(c):
    c.set("scaling.num_hosts", -1)
    return run(c), "scaling.num_hosts"


@case("study-file-fsdp-with-one-worker")
def _(c):
    c.set("scaling.strategy", "fsdp")
    return run(c), "scaling.strategy"


@case("study-file-fsdp-shard-group-not-dividing-the-workers")
def _(c):
    c.set("scaling.workers_per_host", 2)
    c.set("scaling.strategy", "fsdp")
    c.set("scaling.shard_group_size", 3)
    return run(c), "scaling.shard_group_size"


@case("study-file-fsdp-with-fp16")
def _(c):
    c.set("scaling.workers_per_host", 2)
    c.set("scaling.strategy", "fsdp")
    c.set("training.precision", "fp16")
    return run(c), "training.precision"


# --- the workload ----------------------------------------------------------------------------
@case("workload-unknown")
def _(c):
    c.raw["workload"] = "imagenet"
    return run(c), "workload"


@case("workload-module-missing")
def _(c):
    c.raw["workload"] = "no_such_package.models:Net"
    return run(c), "workload"


@case("workload-class-missing")
def _(c):
    c.raw["workload"] = "service.workloads.digits:NoSuchWorkload"
    return run(c), "workload"


@case("workload-not-a-workload")
def _(c):
    c.raw["workload"] = "service.study.spec:Study"
    return run(c), "workload"


@case("workload-metric-unknown")
def _(c):
    c.set("training.metric", "validation/auc")
    return run(c), "training.metric"


@case("valid-control")
def _(c):  # the corpus's valid neighbour: the same world, nothing wrong (not counted as bad)
    return validate_data(c), None


# --- the data ----------------------------------------------------------------------------------
@case("data-train-missing")
def _(c):
    c.raw["data"]["train"] = c.path("no-train")
    return validate_data(c), f"data.train: {c.path('no-train')}"


@case("data-validation-missing-on-run")
def _(c):
    c.raw["data"]["validation"] = c.path("no-val")
    return run(c), f"data.validation: {c.path('no-val')}"


@case("data-test-missing")
def _(c):
    c.raw["data"]["test"] = c.path("no-test")
    return validate_data(c), f"data.test: {c.path('no-test')}"


@case("data-train-folder-empty")
def _(c):
    os.makedirs(c.path("empty"))
    c.raw["data"]["train"] = c.path("empty")
    return validate_data(c), f"data.train: {c.path('empty')}"


@case("data-train-no-parquet-in-folder")
def _(c):
    os.makedirs(c.path("csvs"))
    with open(c.path("csvs", "train.csv"), "w") as f:
        f.write("pixels,label\n0,1\n")
    c.raw["data"]["train"] = c.path("csvs")
    return validate_data(c), f"data.train: {c.path('csvs')}"


@case("data-glob-matches-nothing")
def _(c):
    c.raw["data"]["train"] = os.path.join(c.digits, "train", "*.orc")
    return validate_data(c), f"data.train: {c.raw['data']['train']}"


@case("data-zero-byte-file")
def _(c):
    d = c.data_copy()
    open(os.path.join(d, "part-00009.parquet"), "w").close()
    return validate_data(c), f"data.train: {os.path.join(d, 'part-00009.parquet')}"


@case("data-corrupt-file")
def _(c):
    d = c.data_copy()
    with open(os.path.join(d, "part-00001.parquet"), "wb") as f:
        f.write(os.urandom(4096))
    return run(c), f"data.train: {os.path.join(d, 'part-00001.parquet')}"


@case("data-truncated-file")
def _(c):
    d = c.data_copy("validation")
    p = first_file(d)
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) // 2)
    return validate_data(c), f"data.validation: {p}"


@case("data-csv-given-as-a-file")
def _(c):
    p = c.path("train.csv")
    with open(p, "w") as f:
        f.write("pixels,label\n0,1\n")
    c.raw["data"]["train"] = p
    return validate_data(c), f"data.train: {p}"


@case("data-missing-label-column")
def _(c):
    p = first_file(c.data_copy())
    rewrite_table(p, lambda t: t.drop_columns(["label"]))
    return run(c), f"data.train: {p}"


@case("data-missing-feature-column-in-validation")
def _(c):
    p = first_file(c.data_copy("validation"))
    rewrite_table(p, lambda t: t.rename_columns(["example_id", "image", "label"]))
    return validate_data(c), f"data.validation: {p}"


@case("data-label-column-of-strings")
def _(c):
    p = first_file(c.data_copy())
    rewrite_table(
        p, lambda t: t.set_column(2, "label", pa.array([f"digit-{v}" for v in t["label"].to_pylist()]))
    )
    return run(c), f"data.train: {p}"


@case("data-pixels-of-the-wrong-length")
def _(c):
    p = os.path.join(c.data_copy(), "part-00002.parquet")
    short = lambda t: t.set_column(1, "pixels", pa.array([v[:10] for v in t["pixels"].to_pylist()]))  # noqa: E731
    rewrite_table(p, short)
    return validate_data(c), f"data.train: {p}"


@case("data-split-with-no-rows")
def _(c):
    d = c.path("novalrows")
    os.makedirs(d)
    t = pq.read_table(first_file(os.path.join(c.digits, "validation")))
    pq.write_table(t.slice(0, 0), os.path.join(d, "part-00000.parquet"))
    c.raw["data"]["validation"] = d
    return validate_data(c), f"data.validation: {d}"


@case("data-fewer-files-than-hosts")
def _(c):
    c.set("scaling.num_hosts", 5)
    c.set("training.batch_size", 40)
    c.set("training.eval_batch_size", 80)
    return validate_data(c), "data.train: " + c.raw["data"]["train"]


@case("data-unsupported-uri-scheme")
def _(c):
    c.raw["data"]["train"] = "nosuchfs://bucket/train"
    return validate_data(c), "data.train: nosuchfs://bucket/train"


# --- the storage -------------------------------------------------------------------------------
@case("storage-is-a-file")
def _(c):
    with open(c.path("afile"), "w") as f:
        f.write("x")
    c.raw["storage"] = c.path("afile")
    return run(c), "storage"


@case("storage-permission-denied")
def _(c):
    c.raw["storage"] = unwritable_dir(Path(c.root))
    return run(c), "storage"


@case("storage-unsupported-scheme")
def _(c):
    c.raw["storage"] = "nosuchfs://bucket/studies"
    return run(c), "storage: nosuchfs://bucket/studies"


@case("storage-keeps-failing")
def _(c):
    fsspec.register_implementation("flaky", FlakyMemoryFS, clobber=True)
    FlakyMemoryFS.fail_writes = 10**6
    c.raw["storage"] = f"flaky://bucket-{os.path.basename(c.root)}"
    return run(c), "storage"


@case("storage-override-is-a-file")
def _(c):
    with open(c.path("afile"), "w") as f:
        f.write("x")
    return ["run", c.study_file, "--storage", c.path("afile")], "storage"


@case("storage-stored-study-corrupt")
def _(c):
    os.makedirs(os.path.join(c.storage, "t"))
    with open(os.path.join(c.storage, "t", "study.yaml"), "w") as f:
        f.write("name: [t\n")
    return run(c), os.path.join(c.storage, "t", "study.yaml")


@case("storage-stored-study-not-text")
def _(c):
    os.makedirs(os.path.join(c.storage, "t"))
    with open(os.path.join(c.storage, "t", "study.yaml"), "wb") as f:
        f.write(b"\xff\xfe\x00garbage")
    return run(c), os.path.join(c.storage, "t", "study.yaml")


@case("storage-stored-trial-table-corrupt")
def _(c):
    from service.study import spec
    from service.study.checks import resolve_paths

    study_dir = os.path.join(c.storage, "t")
    os.makedirs(study_dir)
    with open(os.path.join(study_dir, "study.yaml"), "w") as f:
        f.write(spec.dump_yaml(resolve_paths(spec.load_dict(c.raw))))
    with open(os.path.join(study_dir, "trials.parquet"), "wb") as f:
        f.write(b"PAR1 not really")
    return run(c), os.path.join(study_dir, "trials.parquet")


def corrupt_index_object(c: Case) -> str:
    """The study's object in the storage root's index, not JSON (torn by something else)."""
    index = os.path.join(c.storage, "_index")
    os.makedirs(index)
    with open(os.path.join(index, "t.json"), "w") as f:
        f.write('{"study": "t", "state": ')
    return os.path.join(index, "t.json")


@case("studies-index-object-corrupt")
def _(c):
    return ["studies", "--storage", c.storage], corrupt_index_object(c)


def stored_study_with_a_trial(c: Case) -> str:
    """The study stored as a run leaves it before its first trial starts; returns its folder."""
    from service.study import spec
    from service.study.checks import resolve_paths
    from service.tracking.trial_table import TrialTable

    study_dir = os.path.join(c.storage, "t")
    os.makedirs(study_dir)
    with open(os.path.join(study_dir, "study.yaml"), "w") as f:
        f.write(spec.dump_yaml(resolve_paths(spec.load_dict(c.raw))))
    table = TrialTable(study_dir, "validation/error", "min")
    table.update("explore-0000", round="explore", status="PENDING", max_train_steps=40)
    table.save()
    return study_dir


@case("status-index-object-corrupt")
def _(c):
    stored_study_with_a_trial(c)
    return ["status", "t", "--storage", c.storage], corrupt_index_object(c)


@case("status-verdicts-corrupt")
def _(c):
    verdicts = os.path.join(stored_study_with_a_trial(c), "verdicts.json")
    with open(verdicts, "w") as f:
        f.write('[{"round": ')
    return ["status", "t", "--storage", c.storage], verdicts


@case("data-preprocess-record-corrupt")
def _(c):
    """A record `playbook preprocess` would write beside the shards, torn: a run copies it."""
    record = os.path.join(c.data_copy("train"), "_provenance.json")
    with open(record, "w") as f:
        f.write('{"workload": ')
    return run(c), "data.train"


@case("stored-study-grown-with-an-edited-round")
def _(c):
    """Rounds may be added after the stored ones; the stored ones may not change."""
    from service.study import spec
    from service.study.checks import resolve_paths

    study_dir = os.path.join(c.storage, "t")
    os.makedirs(study_dir)
    with open(os.path.join(study_dir, "study.yaml"), "w") as f:
        f.write(spec.dump_yaml(resolve_paths(spec.load_dict(c.raw))))
    c.raw["rounds"] = [{**c.raw["rounds"][0], "num_trials": 3}, {"name": "more", "num_trials": 2}]
    return run(c), "name"


@case("round-search-entry-the-workload-does-not-read")
def _(c):
    c.raw["rounds"].append(
        {"name": "more", "num_trials": 2, "search": {"depth": {"role": "fixed", "value": 3}}}
    )
    return run(c), "rounds[1].search.depth"


@case("from-round-of-an-unknown-study")
def _(c):
    c.raw["rounds"].append(
        {"name": "longer", "kind": "extend", "num_trials": 1, "from_round": "nobody/explore"}
    )
    return run(c), "rounds[1].from_round"


# --- what the cluster can hold (checked after connecting, before any trial) --------------------
@case("resources-more-hosts-than-nodes")
def _(c):
    c.needs_ray = True
    c.set("scaling.num_hosts", 2)
    return run(c), "scaling.num_hosts"


@case("resources-gpu-on-a-cpu-cluster")
def _(c):
    c.needs_ray = True
    c.set("scaling.use_gpu", True)
    return run(c), "scaling.use_gpu"


@case("resources-worker-larger-than-any-node")
def _(c):
    c.needs_ray = True
    c.set("scaling.cpus_per_worker", 3)
    return run(c), "scaling.cpus_per_worker"


@case("resources-more-workers-than-cpus")
def _(c):
    c.needs_ray = True
    c.set("scaling.workers_per_host", 3)
    c.set("training.batch_size", 48)
    c.set("training.eval_batch_size", 96)
    return run(c), "scaling.workers_per_host"


# --- checkpoints given to playbook eval --------------------------------------------------------
@case("eval-checkpoint-without-manifest")
def _(c):
    d = fake_checkpoint(c, lambda d: os.remove(os.path.join(d, checkpoint.MANIFEST_FILE)))
    return ["eval", d], d


@case("eval-checkpoint-state-truncated")
def _(c):
    def cut(d):
        with open(os.path.join(d, checkpoint.STATE_FILE), "r+b") as f:
            f.truncate(10)

    d = fake_checkpoint(c, cut)
    return ["eval", d], d


@case("eval-checkpoint-outside-a-study")
def _(c):
    d = c.path("loose", "checkpoint_0")
    checkpoint.save(TrialState(step=1), d, {"step": 1})
    return ["eval", d], d


@case("status-unknown-study")
def _(c):
    return ["status", "no-such-study", "--storage", c.storage], "no-such-study"
