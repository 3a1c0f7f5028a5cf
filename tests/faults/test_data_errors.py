"""A data error is not transient: `validate --data` checks every file's column types against
what the workload declares, and a trial that meets a bad value fails at once (no retry) with
the file, column and row in its row and in storage."""

from __future__ import annotations

import os
import re
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from service import cli, workloads
from service.core.errors import DataError
from service.data.files import list_files
from service.data.loader import WindowReader, pieces_of
from service.data.sharding import RowRange
from tests.helpers.processes import own_lines
from tests.helpers.studies import TRIAL_LAYOUTS, make_study, study_dict
from tests.helpers.text_workload import as_text

BAD_ROW = 150  # in the second row group of every training file (row groups of 128 rows)
# What the trial with a bad value did before: 3 worker-group attempts in each of 3 Tune
# attempts, ~300 s; one attempt of a 2-worker trial takes well under a minute here.
FAIL_FAST_S = 150


def copy_splits(digits_dir, root, change_train, change_other=lambda t: t) -> dict[str, str]:
    """The digits splits under `root`, each file rewritten by `change_*` (a table -> table)."""
    out = {}
    for split in ("train", "validation", "test"):
        os.makedirs(root / split)
        change = change_train if split == "train" else change_other
        for name in sorted(os.listdir(digits_dir / split)):
            table = change(pq.read_table(digits_dir / split / name))
            pq.write_table(table, root / split / name, row_group_size=128)
        out[split] = str(root / split)
    return out


def labels_as_text(table):
    """The label column as strings, 'n/a' in row BAD_ROW (every earlier label still parses)."""
    labels = [str(v) for v in table.column("label").to_pylist()]
    labels[BAD_ROW] = "n/a"
    return table.set_column(table.schema.get_field_index("label"), "label", pa.array(labels))


def test_validate_data_refuses_a_column_of_another_type_than_declared(digits_dir, tmp_path, capsys):
    """Digits declares `label` an integer column: a column of strings is refused from the
    footer, naming the file and the column, though its first rows would convert."""
    data = copy_splits(digits_dir, tmp_path / "data", labels_as_text)
    raw = study_dict(digits_dir, tmp_path / "storage")
    raw["data"] = data
    study_file = tmp_path / "study.yaml"
    study_file.write_text(yaml.safe_dump(raw))
    capsys.readouterr()
    assert cli.main(["validate", "--data", str(study_file)]) == 2
    err = capsys.readouterr().err.strip()
    first = os.path.join(data["train"], sorted(os.listdir(data["train"]))[0])
    assert err.startswith(f"playbook: error: data.train: {first}: column 'label' is string"), err
    assert "declares it integer" in err and len(err.splitlines()) == 1


def test_the_loader_names_the_file_column_and_row_of_a_bad_value(digits_dir, tmp_path):
    """A value `to_batch` cannot convert: the error names its file, column and row in the file
    (written there by the test), not the window's first file and every column."""
    data = copy_splits(digits_dir, tmp_path / "data", lambda t: as_text(t, BAD_ROW), as_text)
    workload = workloads.get("tests.helpers.text_workload:TextDigits")
    files = list_files(data["train"])
    reader = WindowReader(workload)
    # A window of the last file's two first row groups after the first file's first one.
    pieces = pieces_of([RowRange(files[0], 0, 128), RowRange(files[-1], 0, 256)], reader.reader)
    with pytest.raises(DataError) as e:
        reader.read(pieces)
    assert str(e.value).startswith(f"{files[-1].uri}: column 'pixels', row {BAD_ROW}: "), str(e.value)
    assert "'n/a'" in str(e.value)


@pytest.mark.ray
@pytest.mark.parametrize("layout", TRIAL_LAYOUTS)
def test_a_data_error_fails_the_trial_at_once(ray_cluster, digits_dir, tmp_path, layout):
    from service.orchestration.study_run import run_study

    data = copy_splits(digits_dir, tmp_path / "data", lambda t: as_text(t, BAD_ROW), as_text)
    attempts = tmp_path / "attempts"
    attempts.mkdir()
    study = make_study(
        digits_dir,
        tmp_path / "storage",
        name=f"bad-data-{layout}",
        workload="tests.helpers.text_workload:TextDigits",
        data=data,
        scaling={**TRIAL_LAYOUTS[layout], "cpus_per_worker": 0.5},
        search={
            "learning_rate": {"role": "fixed", "value": 0.1},
            "width": {"role": "fixed", "value": 4},
            "attempts_dir": {"role": "fixed", "value": str(attempts)},
        },
        rounds=[{"name": "explore", "num_trials": 1}],
    )
    start = time.monotonic()
    (row,) = run_study(study)
    elapsed = time.monotonic() - start

    assert row["status"] == "FAILED"
    assert re.match(
        rf"{re.escape(data['train'])}/part-\d+\.parquet: column 'pixels', row {BAD_ROW}: ", row["error"]
    )
    assert "'n/a'" in row["error"]
    with open(os.path.join(study.study_uri, "trials", row["trial_name"], "error.txt")) as f:
        assert f.read().strip() == row["error"]
    stored = {
        r["trial_name"]: r for r in pq.read_table(os.path.join(study.study_uri, "trials.parquet")).to_pylist()
    }
    assert stored[row["trial_name"]]["error"] == row["error"]
    assert len(os.listdir(attempts)) == study.scaling.world_size  # one attempt: one model per rank
    assert elapsed < FAIL_FAST_S, elapsed


@pytest.mark.ray
def test_a_data_error_raised_on_a_pool_actor_is_the_trials_error_in_one_line(ray_cluster):
    """Which rank of a pooled trial meets the bad value first is a race. When a pool actor (a
    rank other than 0) won it, the trial's error was Ray's wrapping of the DataError, whose text
    names the actor and holds its traceback (the [pool] case above failed so once)."""
    from service.orchestration.ray_private import final_error_of

    message = "part-00002.parquet: column 'pixels', row 150: cannot turn it into a batch"

    @ray_cluster.remote(num_cpus=0)
    class Rank:
        def train(self):
            raise DataError(message)

    with pytest.raises(DataError) as raised:
        ray_cluster.get(Rank.remote().train.remote())
    assert "ray::Rank.train()" in str(raised.value)  # Ray's wrapping
    error = final_error_of(raised.value, "unused")
    assert type(error) is DataError and str(error) == message


def test_a_column_type_that_is_no_kind_is_refused_by_validate(digits_dir, tmp_path, capsys):
    raw = study_dict(digits_dir, tmp_path / "storage", workload="tests.helpers.text_workload:MistypedDigits")
    study_file = tmp_path / "study.yaml"
    study_file.write_text(yaml.safe_dump(raw))
    capsys.readouterr()
    assert cli.main(["validate", str(study_file)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "playbook: error: workload: mistyped_digits.column_types['label'] = 'int': not a kind"
    )


@pytest.mark.ray
def test_another_failure_is_retried_and_its_error_kept_in_storage(ray_cluster, digits_dir, tmp_path):
    """Not a data error: Tune retries the trial (MAX_TRIAL_RESTARTS), then the row holds the
    error's last line (not a path in Ray's session folder) and error.txt the whole of it."""
    from service.orchestration.study_run import run_study
    from service.orchestration.tune_fit import MAX_TRIAL_RESTARTS

    data = copy_splits(digits_dir, tmp_path / "data", as_text, as_text)
    attempts = tmp_path / "attempts"
    attempts.mkdir()
    study = make_study(
        digits_dir,
        tmp_path / "storage",
        name="broken-model",
        workload="tests.helpers.text_workload:BrokenModelDigits",
        data=data,
        search={
            "learning_rate": {"role": "fixed", "value": 0.1},
            "width": {"role": "fixed", "value": 4},
            "attempts_dir": {"role": "fixed", "value": str(attempts)},
        },
        rounds=[{"name": "explore", "num_trials": 1}],
    )
    (row,) = run_study(study)
    error_txt = os.path.join(study.study_uri, "trials", row["trial_name"], "error.txt")
    assert row["status"] == "FAILED"
    assert row["error"].startswith("RuntimeError: this model cannot be built"), row["error"]
    assert row["error"].endswith(f"(all of it: {error_txt})")
    with open(error_txt) as f:
        text = f.read()
    assert f"Failure # {1 + MAX_TRIAL_RESTARTS}" in text  # every attempt's traceback
    assert 'in build_model\n    raise RuntimeError("this model cannot be built")' in text
    assert len(os.listdir(attempts)) == 1 + MAX_TRIAL_RESTARTS


def test_a_relative_data_path_from_another_folder_names_the_field_and_the_resolved_path(
    digits_dir, tmp_path, capsys, monkeypatch
):
    """A study whose data paths are relative, validated from the folder above its own: the error
    names the field and the path as resolved, against the working directory (not the study
    file's folder, where the data is)."""
    study_dir = tmp_path / "project"
    study_dir.mkdir()
    copy_splits(digits_dir, study_dir / "data", lambda t: t)
    raw = study_dict(digits_dir, "studies")
    raw["data"] = {s: f"data/{s}" for s in ("train", "validation", "test")}
    (study_dir / "study.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert cli.main(["validate", "--data", "project/study.yaml"]) == 2
    err = own_lines(capsys.readouterr().err)
    assert err == [f"playbook: error: data.train: {tmp_path}/data/train: no such file or directory"]
    monkeypatch.chdir(study_dir)
    assert cli.main(["validate", "--data", "study.yaml"]) == 0, capsys.readouterr().err
