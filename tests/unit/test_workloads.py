"""Built-in workloads: digits columns to tensors, and 'is it a zero?' as a 1:9 imbalanced task.
The Workload contract (docs/workloads.md) on the tabular example of studies/tabular: ids in a
column of its own, a classifier's outputs, one value per example, a regression's outputs, and
a module of one's own imported from the study file's folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from sklearn.datasets import load_digits

import service
from service import workloads
from service.core import storage
from service.core.errors import DataError, SpecError
from service.data.files import list_files
from service.data.loader import TrainStream, eval_batches
from service.data.sharding import row_ranges
from service.distributed import checkpoint
from service.distributed.topology import Topology
from service.evaluation import predictions as prediction_files
from service.evaluation.offline import evaluate_checkpoint
from service.evaluation.predictions import PredictionLog
from service.evaluation.run import evaluate
from service.study import spec
from service.study.checks import check_data
from tests.helpers import contract_workloads as cw
from tests.helpers.studies import digits_logits, make_study


def test_digits_batches_are_the_sklearn_images(digits_dir):
    table = pq.read_table(str(digits_dir / "train"))
    batch = workloads.get("digits").to_batch(table)
    ref = load_digits()
    ids = table.column("example_id").to_numpy()
    np.testing.assert_allclose(
        batch["features"].reshape(len(ids), 64).numpy(), ref.data[ids] / 16.0, rtol=1e-6
    )
    np.testing.assert_array_equal(batch["label"].numpy(), ref.target[ids])


def test_digits_zero_is_the_imbalanced_binary_task(digits_dir):
    table = pq.read_table(str(digits_dir / "validation"))
    batch = workloads.get("digits_zero").to_batch(table)
    digits = table.column("label").to_numpy()
    np.testing.assert_array_equal(batch["label"].numpy(), (digits == 0).astype(np.int64))
    positives = int(batch["label"].sum())
    assert 0 < positives < len(digits) / 5  # about 1 in 10
    model = workloads.get("digits_zero").build_model({"width": 4})
    assert model(batch["features"][:3]).shape == (3, 2)


BIN = os.path.dirname(sys.executable)


@pytest.fixture(scope="module")
def tabular_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tabular")
    cw.write_tabular_data(str(root))
    return root


def features_of(table):
    """The tabular columns as a float32 [rows, 6] tensor, read with pyarrow directly."""
    x = np.stack([table.column(f"f{i}").to_numpy() for i in range(cw.NUM_FEATURES)], axis=1)
    return torch.from_numpy(x.astype(np.float32))


def predictions_of(workload, model, split_dir, batch_size=50):
    ranges = row_ranges(list_files(str(split_dir)), 0, 1)
    log = PredictionLog(workload.metric_names, workload.num_classes)
    metrics = evaluate(
        model, workload, eval_batches(workload, ranges, batch_size), batch_size, torch.device("cpu"), log
    )
    return metrics, log.gather()


def test_an_id_column_of_its_own_names_every_batch_and_prediction(tabular_dir):
    """id_column = 'row_id' (ids from 1000 on): the loader reads it, whatever to_batch returns
    (it returns no ids), and every prediction row carries it; the predictions match a plain
    torch pass over the columns read with pyarrow."""
    workload = cw.TabularMLP()
    table = pq.read_table(str(tabular_dir / "validation"))
    row_ids = table.column("row_id").to_numpy()
    assert row_ids.min() >= 1000

    stream = TrainStream(workload, row_ranges(list_files(str(tabular_dir / "train")), 0, 1), 32, data_seed=0)
    train_ids = set(pq.read_table(str(tabular_dir / "train")).column("row_id").to_pylist())
    assert set(stream.batch(0)["example_id"].tolist()) <= train_ids

    torch.manual_seed(0)
    model = workload.build_model({}).eval()
    metrics, rows = predictions_of(workload, model, tabular_dir / "validation")
    np.testing.assert_array_equal(rows["example_id"], row_ids)
    with torch.no_grad():
        logits = model(features_of(table)).double()
    labels = table.column("y").to_numpy()
    np.testing.assert_array_equal(rows["prediction"], logits.argmax(1).numpy())
    np.testing.assert_allclose(rows["score"], torch.softmax(logits, 1).max(1).values.numpy(), rtol=1e-5)
    wrong = (logits.argmax(1).numpy() != labels).astype(float)
    np.testing.assert_array_equal(rows["metric/error"], wrong)
    assert metrics["error"] == pytest.approx(wrong.mean())
    assert [c["class"] for c in metrics["per_class"]] == [0, 1, 2]  # num_classes = 3


def test_ids_must_be_integers(tabular_dir, tmp_path):
    table = pq.read_table(str(tabular_dir / "validation"))
    ids = pa.array([f"r{i}" for i in table.column("row_id").to_pylist()])
    pq.write_table(table.set_column(0, "row_id", ids), tmp_path / "part-000.parquet")
    ranges = row_ranges(list_files(str(tmp_path)), 0, 1)
    with pytest.raises(
        DataError, match=r"part-000.parquet: column 'row_id' \(id_column of workload tabular_mlp\)"
    ):
        next(eval_batches(cw.TabularMLP(), ranges, 8))


def test_a_regression_keeps_its_outputs_in_the_predictions(tabular_dir, tmp_path):
    """num_classes None and [batch, 1] outputs: an `output` column (the model's output), float
    labels, no prediction/score and no per-class metrics."""
    workload = cw.Regression()
    torch.manual_seed(0)
    model = workload.build_model({}).eval()
    metrics, rows = predictions_of(workload, model, tabular_dir / "validation")
    table = pq.read_table(str(tabular_dir / "validation"))
    with torch.no_grad():
        out = model(features_of(table))[:, 0].double().numpy()
    np.testing.assert_allclose(rows["output"], out, rtol=1e-6)
    assert "per_class" not in metrics and "prediction" not in rows
    prediction_files.write(str(tmp_path / "p.parquet"), rows, "validation", 7)
    written = pq.read_table(str(tmp_path / "p.parquet"))
    assert written.schema.field("label").type == pa.float64()
    np.testing.assert_array_equal(written.column("label").to_numpy(), table.column("y").to_numpy())
    np.testing.assert_allclose(written.column("output").to_numpy(), out, rtol=1e-6)


def tabular_study(tabular_dir, tmp_path, workload: str) -> dict:
    """The example's study file, as plain data, on `workload` and the data in `tabular_dir`."""
    with open(os.path.join(cw.STUDY_DIR, "study.yaml")) as f:
        d = yaml.safe_load(f)
    d["workload"] = workload
    d["data"] = {s: str(tabular_dir / s) for s in ("train", "validation", "test")}
    d["storage"] = str(tmp_path / "studies")
    return d


@pytest.mark.parametrize(
    ("workload", "message"),
    [
        (
            "tests.helpers.contract_workloads:WrongWidth",
            r"num_classes = 4 needs outputs of shape \[batch, 4\].*\[4, 3\]",
        ),
        (
            "tests.helpers.contract_workloads:MeanLoss",
            r"loss\(\) must be one value per row, shape \[4\]; got shape \[\]",
        ),
    ],
)
def test_a_broken_contract_is_refused_before_anything_starts(tabular_dir, tmp_path, workload, message):
    with pytest.raises(SpecError, match=message):
        check_data(spec.load_dict(tabular_study(tabular_dir, tmp_path, workload)))


def test_offline_eval_predictions_have_the_per_example_metric_columns(digits_dir, tmp_path):
    """`playbook eval`'s predictions.parquet has the metric/<name> columns training's have, and
    they are the per-example values of an independent pass over the split."""
    study = make_study(digits_dir, tmp_path)
    storage.write_bytes_atomic(storage.join(study.study_uri, "study.yaml"), spec.dump_yaml(study).encode())
    torch.manual_seed(0)
    model = workloads.get("digits").build_model({"width": 4})
    state = checkpoint.TrialState(step=3, model=model.state_dict(), hparams={"width": 4})
    ckpt = os.path.join(study.study_uri, "trials", "explore-0000", "checkpoint_000000")
    checkpoint.save(state, ckpt, {})

    metrics = evaluate_checkpoint(ckpt, "test", Topology())
    out = os.path.join(study.study_uri, "trials", "explore-0000", "evals", "test-checkpoint_000000")
    preds = pq.read_table(os.path.join(out, "predictions.parquet")).to_pandas()
    assert {"metric/loss", "metric/error"} <= set(preds.columns)

    logits, labels = digits_logits(state, digits_dir / "test")
    ids = pq.read_table(str(digits_dir / "test")).column("example_id").to_numpy()
    loss = torch.nn.functional.cross_entropy(
        torch.from_numpy(logits), torch.from_numpy(labels), reduction="none"
    )
    want = dict(zip(ids, loss.numpy(), strict=True))
    np.testing.assert_allclose(preds["metric/loss"], [want[i] for i in preds["example_id"]], rtol=1e-5)
    error = dict(zip(ids, (logits.argmax(1) != labels).astype(float), strict=True))
    np.testing.assert_array_equal(preds["metric/error"], [error[i] for i in preds["example_id"]])
    with open(os.path.join(out, "metrics.json")) as f:
        assert (
            json.load(f)["error"]
            == pytest.approx(metrics["error"])
            == pytest.approx(preds["metric/error"].mean())
        )


def write_own_workload(folder, module: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with open(os.path.join(cw.STUDY_DIR, "tabular_workload.py")) as f:
        (folder / f"{module}.py").write_text(f.read())


@pytest.mark.parametrize("where", ["the module's folder", "another folder"])
def test_playbook_validate_imports_a_workload_from_the_study_files_folder(tabular_dir, tmp_path, where):
    """`playbook validate --data` (the console script, whose own folder is what Python puts on
    its path) finds `mine_<n>:TabularMLP` beside the study file, run from that folder or from
    another one."""
    module = f"mine_{abs(hash(where)) % 10_000}"
    folder = tmp_path / "project"
    write_own_workload(folder, module)
    d = tabular_study(tabular_dir, tmp_path, f"{module}:TabularMLP")
    (folder / "study.yaml").write_text(yaml.safe_dump(d))
    cwd = folder if where == "the module's folder" else tmp_path
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(service.__file__)))  # this tree's
    out = subprocess.run(
        [f"{BIN}/playbook", "validate", "--data", str(folder / "study.yaml")],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ok: study tabular-example")


def test_the_documented_example_is_the_one_the_tests_run():
    """docs/workloads.md shows studies/tabular/tabular_workload.py whole, as it is (the module
    the contract tests and tests/cluster/test_own_workload_study.py run)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "workloads.md")) as f:
        doc = f.read()
    with open(os.path.join(cw.STUDY_DIR, "tabular_workload.py")) as f:
        code = f.read()
    assert f"`tabular_workload.py`:\n\n```python\n{code}```\n" in doc


def test_the_jobs_pythonpath_carries_the_import_path(tmp_path, monkeypatch):
    """A folder inside the working directory: relative (a `--working-dir` job's worker resolves
    it in its own copy) and absolute; one outside: absolute; the driver's PYTHONPATH after them.
    A Ray job whose runtime env sets PYTHONPATH itself gets none (Ray refuses a second value)."""
    study_dir, outside = tmp_path / "user" / "studies" / "mine", tmp_path / "lib"
    cwd = tmp_path / "user"
    monkeypatch.setenv("PYTHONPATH", "/opt/site")
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    paths = workloads.import_path(str(study_dir / "study.yaml"), cwd=str(cwd))
    assert paths == [str(study_dir), str(cwd)]
    env = workloads.ray_env([*paths, str(outside)], cwd=str(cwd))
    want = ["studies/mine", str(study_dir), ".", str(cwd), str(outside), "/opt/site"]
    assert env == {"PYTHONPATH": os.pathsep.join(want)}
    assert workloads.import_path("gs://bucket/s/study.yaml", cwd=str(cwd)) == [str(cwd)]

    job = {"runtime_env": {"env_vars": {"PYTHONPATH": "/theirs"}}}
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(job))
    assert workloads.ray_env(paths, cwd=str(cwd)) == {}
