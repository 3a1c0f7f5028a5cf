"""A whole study on gs:// (gcsfs against gcp-storage-emulator on loopback): data, checkpoints,
metrics and the trial table written there by Ray workers, and read back from there alone."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys

import gcsfs
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from service import cli, workloads
from service.distributed import checkpoint
from tests.helpers.studies import study_dict

pytestmark = pytest.mark.ray


def emulator_fs() -> gcsfs.GCSFileSystem:
    """A client of our own (not the service's `storage.split`) for reading back."""
    return gcsfs.core.GCSFileSystem(
        token="anon", project="test", endpoint_url=os.environ["STORAGE_EMULATOR_HOST"]
    )


def test_a_study_on_gs_writes_everything_there_and_reads_it_back(ray_cluster, gcs_emulator, tmp_path, capsys):
    data = f"{gcs_emulator}/data"
    assert cli.main(["data", "digits", data]) == 0
    d = study_dict(tmp_path, f"{gcs_emulator}/studies", name="on-gcs")
    d["data"] = {s: f"{data}/{s}" for s in ("train", "validation", "test")}
    study_file = tmp_path / "study.yaml"
    study_file.write_text(yaml.safe_dump(d))
    assert cli.main(["run", str(study_file)]) == 0

    fs = emulator_fs()
    root = f"{gcs_emulator.removeprefix('gs://')}/studies/on-gcs"
    with fs.open(f"{root}/trials.parquet", "rb") as f:
        rows = pq.read_table(f).to_pylist()
    assert sorted(r["trial_name"] for r in rows) == ["explore-0000", "explore-0001"]
    for row in rows:
        assert row["status"] == "FINISHED" and row["step"] == 40
        assert 0 <= row["input/exposed_fraction"] <= 1 and row["input/verdict"]
        # The best checkpoint is on gs://, and its model reproduces the row's metric on the
        # validation files read straight from the emulator (an evaluation independent of ours).
        assert row["best_checkpoint"].startswith(f"{gcs_emulator}/studies/on-gcs/trials/{row['trial_name']}/")
        with fs.open(row["best_checkpoint"].removeprefix("gs://") + "/state.pt", "rb") as f:
            state = checkpoint.load_file(io.BytesIO(f.read()))
        assert state.step == row["best_step"]
        model = workloads.get("digits").build_model(state.hparams)
        model.load_state_dict(state.model)
        model.eval()
        files = sorted(fs.find(f"{gcs_emulator.removeprefix('gs://')}/data/validation"))
        tables = []
        for p in files:
            with fs.open(p, "rb") as f:
                tables.append(pq.read_table(f))
        x = np.concatenate([np.stack(t.column("pixels").to_numpy(zero_copy_only=False)) for t in tables])
        y = np.concatenate([t.column("label").to_numpy() for t in tables])
        with torch.no_grad():
            logits = model(torch.from_numpy(x.astype(np.float32)).view(-1, 1, 8, 8)).double().numpy()
        logp = logits - logits.max(1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(1, keepdims=True))
        assert math.isclose(-logp[np.arange(len(y)), y].mean(), row["best_metric"], rel_tol=1e-4)
        with fs.open(f"{root}/trials/{row['trial_name']}/metrics.jsonl", "rb") as f:
            log = [json.loads(line) for line in f.read().decode().splitlines()]
        assert [r["step"] for r in log] == [20, 40]
        with fs.open(f"{root}/trials/{row['trial_name']}/topology.json", "rb") as f:
            opened = json.load(f)["ranks"][0]["train_files"]
        assert opened and all(u.startswith(f"{data}/train/") for u in opened)
    for name in ("study.yaml", "verdicts.json", "provenance.json", "trials.csv"):
        assert fs.exists(f"{root}/{name}"), name

    # `playbook status` in a fresh process with no Ray to ask: everything from gs://.
    out = subprocess.run(
        [sys.executable, "-m", "service", "status", "on-gcs", "--storage", f"{gcs_emulator}/studies"],
        capture_output=True,
        text=True,
        env={**os.environ, "RAY_ADDRESS": ""},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert f"study on-gcs: finished; stored at {gcs_emulator}/studies/on-gcs" in out.stdout
    assert "explore-0000" in out.stdout and "explore-0001" in out.stdout and "best trial:" in out.stdout
