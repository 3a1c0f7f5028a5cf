"""`study.layout`: every path of a study on storage, spelled in one place. The paths are checked
against hand-written strings (studies already on storage must keep being found), and a small
study written by the code itself is checked to hold exactly the files its layout names."""

from __future__ import annotations

import os
import subprocess

import pytest

from service.core.errors import StorageError
from service.study.layout import RootLayout, StudyLayout, TrialLayout, checkpoint_name
from tests.helpers.studies import make_study

ROOTS = ["/data/studies", "gs://bucket/some/studies"]


@pytest.mark.parametrize("root", ROOTS)
def test_every_path_of_a_study_is_the_one_studies_on_storage_have(root):
    s = StudyLayout.of(root, "cifar")
    assert (
        s == StudyLayout(f"{root}/cifar") == StudyLayout(f"{root}/cifar/") == RootLayout(root).study("cifar")
    )
    assert (s.uri, s.name, s.root) == (f"{root}/cifar", "cifar", RootLayout(root))
    expected = {
        "study_file": "study.yaml",
        "verdicts": "verdicts.json",
        "trials_parquet": "trials.parquet",
        "trials_csv": "trials.csv",
        "provenance": "provenance.json",
        "uncommitted_diff": "uncommitted.diff",
        "data_provenance": "data_provenance.json",
        "find_steps": "find_steps.json",
        "report": "report.html",
        "tune_dir": "tune",
        "evals_dir": "evals",
        "trials_dir": "trials",
    }
    assert {k: getattr(s, k) for k in expected} == {k: f"{root}/cifar/{v}" for k, v in expected.items()}
    assert s.write_probe("ab12") == f"{root}/cifar/.write-probe-ab12"
    assert s.index_entry == f"{root}/_index/cifar.json"

    r = RootLayout(root)
    assert (r.index_dir, r.index_entry("x"), r.studies_parquet, r.studies_csv) == (
        f"{root}/_index",
        f"{root}/_index/x.json",
        f"{root}/studies.parquet",
        f"{root}/studies.csv",
    )


@pytest.mark.parametrize("root", ROOTS)
def test_every_path_of_a_trial_is_the_one_trials_on_storage_have(root):
    t = StudyLayout.of(root, "cifar").trial("explore-3")
    base = f"{root}/cifar/trials/explore-3"
    assert (t.uri, t.name, t.study) == (base, "explore-3", StudyLayout(f"{root}/cifar"))
    assert t.metrics_log == f"{base}/metrics.jsonl"
    assert t.topology == f"{base}/topology.json"
    assert t.error_file == f"{base}/error.txt"
    assert t.profile_trace == f"{base}/profile/rank0.trace.json"
    assert (
        t.predictions("validation-sample", 120)
        == f"{base}/predictions/validation-sample-step00000120.parquet"
    )
    assert checkpoint_name(120) == "checkpoint_00000120"
    assert t.checkpoint(120) == f"{base}/checkpoint_00000120"
    assert t.eval_dir("test", "checkpoint_00000120") == f"{base}/evals/test-checkpoint_00000120"
    assert (
        t.eval_metrics("test", "checkpoint_00000120") == f"{base}/evals/test-checkpoint_00000120/metrics.json"
    )
    assert (
        t.eval_predictions("test", "checkpoint_00000120")
        == f"{base}/evals/test-checkpoint_00000120/predictions.parquet"
    )
    # Ray Train names its checkpoints its own way; the trial is found from any of them.
    assert TrialLayout.of_checkpoint(f"{base}/checkpoint_2026-01-02_03-04-05.678901/") == t


def test_a_folder_outside_a_trials_folder_is_no_trial_checkpoint():
    with pytest.raises(StorageError, match="not a trial checkpoint"):
        TrialLayout.of_checkpoint("/data/studies/cifar/explore-3/checkpoint_00000120")


class Keep:
    """A loop reporter: the checkpoints go to the trial's store, nothing is restored."""

    def report(self, metrics, checkpoint_dir):
        pass

    def restore(self):
        return None


def files_under(folder) -> list[str]:
    """Every file under `folder`, by its path relative to it."""
    return sorted(
        os.path.relpath(os.path.join(d, f), folder) for d, _, names in os.walk(folder) for f in names
    )


def dirty_repo_workload(repo, monkeypatch) -> str:
    """A workload module of one's own, committed in a git repository with an uncommitted change
    beside it (so provenance saves a diff); returns its `module:Class`."""
    repo.mkdir()
    (repo / "layout_wl.py").write_text(
        "from service.workloads.digits import Digits\n\n\nclass Mine(Digits):\n    name = 'mine'\n"
    )
    (repo / "notes.txt").write_text("a\n")
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "first"]):
        subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@x.invalid", *args], cwd=repo, check=True
        )
    (repo / "notes.txt").write_text("b\n")
    monkeypatch.syspath_prepend(str(repo))
    return "layout_wl:Mine"


def test_a_study_written_by_the_code_holds_exactly_the_files_its_layout_names(
    digits_dir, tmp_path, monkeypatch
):
    """A trial trained by the step loop (checkpoints through the fast path's store, predictions,
    a profiled step), `playbook eval` of its checkpoint, the trial table, provenance and the
    storage root's index: every file each wrote is a path of the layout, and each such path
    exists."""
    from service.distributed.checkpoint import MANIFEST_FILE, META_FILE, STATE_FILE
    from service.distributed.checkpoint_store import CheckpointStore, SyncCheckpointer
    from service.distributed.topology import Topology
    from service.evaluation.offline import evaluate_checkpoint
    from service.planning.trial import TrialPlan
    from service.study import spec
    from service.tracking import provenance, study_index
    from service.tracking.trial_table import TrialTable
    from service.trainer.loop import train

    root = tmp_path / "studies"
    study = make_study(
        digits_dir,
        root,
        name="laid-out",
        training={"max_train_steps": 20, "eval_every_steps": 10, "num_checkpoints_to_keep": 5},
        input={"profile_steps": 1},
    )
    layout = study.layout
    assert layout == StudyLayout(str(root / "laid-out"))
    plan = TrialPlan(study, "explore-0", "explore", {"learning_rate": 0.1, "momentum": 0.9, "width": 4})
    trial = layout.trial("explore-0")
    store = CheckpointStore(plan.trial_uri, 5, study.training.metric, study.training.mode)
    train(plan, Topology(), Keep(), checkpointer=SyncCheckpointer(store))

    # `playbook eval` reads the stored study file next to the checkpoint.
    with open(root / "laid-out" / "study.yaml", "w") as f:
        f.write(spec.dump_yaml(study))
    evaluate_checkpoint(trial.checkpoint(20), "test", Topology())

    table = TrialTable(layout.uri, study.training.metric, study.training.mode)
    table.update("explore-0", status="FINISHED", best_metric=0.5)
    table.save()
    record = provenance.capture(layout.uri, dirty_repo_workload(tmp_path / "repo", monkeypatch), [])
    study_index.record_study(study, table.snapshot(), "finished", record)
    study_index.compile_table(study.storage)

    checkpoints = [trial.checkpoint(s) for s in (10, 20)]
    expected = {
        layout.study_file,
        layout.trials_parquet,
        layout.trials_csv,
        layout.provenance,
        layout.uncommitted_diff,
        trial.metrics_log,
        trial.topology,
        trial.profile_trace,
        trial.predictions("validation", 10),
        trial.predictions("validation", 20),
        *(f"{c}/{name}" for c in checkpoints for name in (STATE_FILE, META_FILE, MANIFEST_FILE)),
        trial.eval_metrics("test", "checkpoint_00000020"),
        trial.eval_predictions("test", "checkpoint_00000020"),
        layout.index_entry,
        layout.root.studies_parquet,
        layout.root.studies_csv,
    }
    assert files_under(root) == sorted(os.path.relpath(p, root) for p in expected)
    assert record["uncommitted_diff"] == layout.uncommitted_diff
    assert provenance.read(layout.uri) == record
