"""Where a study lives on storage. Every path of a study, and of the storage root's study index,
is spelled here and nowhere else: the modules that read and write them ask a layout for the URI
(the reads and writes themselves are `core.storage`'s). Studies already on storage are read back
through the same layout, so a name here never changes.

    <root>/_index/<study>.json            the study's row of the root's study index
    <root>/studies.parquet, studies.csv   the root's studies table, compiled from _index/
    <root>/<study>/                       one study (`StudyLayout`)
        study.yaml                        the study file as run (a rerun must match it)
        verdicts.json                     one summary per finished round
        trials.parquet, trials.csv        the trial table
        provenance.json, uncommitted.diff where the code came from
        data_provenance.json              the training data's preprocess record
        find_steps.json                   `playbook find-steps`' answer
        batch_size.json, batch_size.txt   `playbook find-batch-size`' table and reading
        report.html                       `playbook report`'s page (by default)
        tune/<run>/                       Ray Tune's storage, one folder per Tune run
        evals/                            Ray Train's storage for `playbook eval` runs
        trials/<trial>/                   one trial (`TrialLayout`), also its Ray Train run's folder
            metrics.jsonl                 rank 0's log, one row per evaluation
            topology.json                 where each rank ran
            error.txt                     a failed trial's error
            attempt.json                  the trial's current attempt (`distributed.fence`)
            predictions/<split>-step<step>.parquet
            profile/rank0.trace.json      the profiled steps (input.profile_steps)
            checkpoint_*/                 checkpoints (the fast path's: checkpoint_<step>; the
                                          files inside are `distributed.checkpoint`'s)
            evals/<split>-<checkpoint>/   `playbook eval`'s metrics.json and predictions.parquet
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from service.core import storage
from service.core.errors import StorageError

INDEX_DIR = "_index"
CHECKPOINT_PREFIX = "checkpoint_"
"""Every checkpoint folder of a trial starts with it (Ray Train's and the fast path's)."""
TRIALS_DIR = "trials"


def checkpoint_name(step: int) -> str:
    """The folder name of the fast path's checkpoint of `step`."""
    return f"{CHECKPOINT_PREFIX}{step:08d}"


def _parent(uri: str) -> str:
    return uri.rsplit("/", 1)[0]


def _base(uri: str) -> str:
    return uri.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class RootLayout:
    """A storage root: the folder that holds studies and their index."""

    root: str

    def study(self, name: str) -> StudyLayout:
        return StudyLayout(storage.join(self.root, name))

    @property
    def index_dir(self) -> str:
        return storage.join(self.root, INDEX_DIR)

    def index_entry(self, study_name: str) -> str:
        """The object that the study `study_name` alone writes (its row of the studies table)."""
        return storage.join(self.index_dir, f"{study_name}.json")

    @property
    def studies_parquet(self) -> str:
        return storage.join(self.root, "studies.parquet")

    @property
    def studies_csv(self) -> str:
        return storage.join(self.root, "studies.csv")


@dataclass(frozen=True)
class StudyLayout:
    """The paths of the study stored at `uri` (`<root>/<study name>`)."""

    uri: str

    def __post_init__(self):
        object.__setattr__(self, "uri", self.uri.rstrip("/"))

    @classmethod
    def of(cls, root: str, name: str) -> StudyLayout:
        return RootLayout(root).study(name)

    @property
    def name(self) -> str:
        return _base(self.uri)

    @property
    def root(self) -> RootLayout:
        return RootLayout(_parent(self.uri))

    @property
    def index_entry(self) -> str:
        return self.root.index_entry(self.name)

    @property
    def study_file(self) -> str:
        return storage.join(self.uri, "study.yaml")

    @property
    def verdicts(self) -> str:
        return storage.join(self.uri, "verdicts.json")

    @property
    def trials_parquet(self) -> str:
        return storage.join(self.uri, "trials.parquet")

    @property
    def trials_csv(self) -> str:
        return storage.join(self.uri, "trials.csv")

    @property
    def provenance(self) -> str:
        return storage.join(self.uri, "provenance.json")

    @property
    def uncommitted_diff(self) -> str:
        return storage.join(self.uri, "uncommitted.diff")

    @property
    def data_provenance(self) -> str:
        return storage.join(self.uri, "data_provenance.json")

    @property
    def find_steps(self) -> str:
        return storage.join(self.uri, "find_steps.json")

    @property
    def batch_size(self) -> str:
        return storage.join(self.uri, "batch_size.json")

    @property
    def batch_size_table(self) -> str:
        return storage.join(self.uri, "batch_size.txt")

    @property
    def report(self) -> str:
        return storage.join(self.uri, "report.html")

    @property
    def tune_dir(self) -> str:
        return storage.join(self.uri, "tune")

    @property
    def evals_dir(self) -> str:
        return storage.join(self.uri, "evals")

    @property
    def trials_dir(self) -> str:
        return storage.join(self.uri, TRIALS_DIR)

    def trial(self, trial_name: str) -> TrialLayout:
        return TrialLayout(storage.join(self.trials_dir, trial_name))

    def write_probe(self, token: str) -> str:
        """A file that pre-flight writes and removes to check the study folder is writable."""
        return storage.join(self.uri, f".write-probe-{token}")


@dataclass(frozen=True)
class TrialLayout:
    """The paths of the trial stored at `uri` (`<study>/trials/<trial name>`)."""

    uri: str

    def __post_init__(self):
        object.__setattr__(self, "uri", self.uri.rstrip("/"))

    @classmethod
    def of_checkpoint(cls, checkpoint_uri: str) -> TrialLayout:
        """The trial whose checkpoint is at `checkpoint_uri` (`<study>/trials/<trial>/checkpoint_*`)."""
        trial_uri = posixpath.dirname(checkpoint_uri.rstrip("/"))
        if posixpath.basename(posixpath.dirname(trial_uri)) != TRIALS_DIR:
            raise StorageError(
                f"{checkpoint_uri}: not a trial checkpoint (expected <study>/trials/<trial>/checkpoint_...)"
            )
        return cls(trial_uri)

    @property
    def name(self) -> str:
        return _base(self.uri)

    @property
    def study(self) -> StudyLayout:
        return StudyLayout(_parent(_parent(self.uri)))

    @property
    def metrics_log(self) -> str:
        return storage.join(self.uri, "metrics.jsonl")

    @property
    def topology(self) -> str:
        return storage.join(self.uri, "topology.json")

    @property
    def error_file(self) -> str:
        return storage.join(self.uri, "error.txt")

    @property
    def attempt(self) -> str:
        """The trial's current attempt: a stranded older attempt's writes are refused."""
        return storage.join(self.uri, "attempt.json")

    @property
    def profile_trace(self) -> str:
        return storage.join(self.uri, "profile", "rank0.trace.json")

    def predictions(self, split: str, step: int) -> str:
        return storage.join(self.uri, "predictions", f"{split}-step{step:08d}.parquet")

    def checkpoint(self, step: int) -> str:
        """The fast path's checkpoint folder of `step`."""
        return storage.join(self.uri, checkpoint_name(step))

    def eval_dir(self, split: str, checkpoint: str) -> str:
        """`playbook eval`'s output for the checkpoint folder named `checkpoint` on `split`."""
        return storage.join(self.uri, "evals", f"{split}-{checkpoint}")

    def eval_metrics(self, split: str, checkpoint: str) -> str:
        return storage.join(self.eval_dir(split, checkpoint), "metrics.json")

    def eval_predictions(self, split: str, checkpoint: str) -> str:
        return storage.join(self.eval_dir(split, checkpoint), "predictions.parquet")
