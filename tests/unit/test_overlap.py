"""Training examples also in validation / test, by id: refused at `playbook validate --data` and
at run start (before anything starts), or a warning with the count when the study allows it;
exact on small splits, estimated from a seeded sample of row groups on large ones."""

from __future__ import annotations

import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from service.cli import main
from service.data import overlap
from service.data.files import list_files
from tests.helpers.studies import study_dict


def leaky_copy(digits_dir, tmp_path, leaked: int):
    """The digits splits with `leaked` training rows appended to the validation split."""
    root = tmp_path / "data"
    shutil.copytree(digits_dir, root)
    train = pq.read_table(str(digits_dir / "train"))
    files = sorted((root / "validation").glob("*.parquet"))
    extra = train.slice(0, leaked).cast(pq.read_schema(files[-1]))
    pq.write_table(extra, root / "validation" / "zz-leaked.parquet")
    return root


def write_study(root, tmp_path, **data) -> str:
    raw = study_dict(root, tmp_path / "storage")
    raw["data"].update(data)
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def count_by_hand(root, split: str) -> int:
    train = set(pq.read_table(str(root / "train")).column("example_id").to_pylist())
    return sum(i in train for i in pq.read_table(str(root / split)).column("example_id").to_pylist())


def test_validate_data_refuses_an_overlap_with_its_count(digits_dir, tmp_path, capsys):
    root = leaky_copy(digits_dir, tmp_path, leaked=7)
    assert count_by_hand(root, "validation") == 7 and count_by_hand(root, "test") == 0
    study = write_study(root, tmp_path)
    assert main(["validate", "--data", study]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "7 of 277 validation examples have an example_id that is also in the training split" in err
    assert "data.allow_overlap: true" in err
    # the study field first, as every other bad-input error names it, then the path
    assert err.startswith(f"playbook: error: data.validation: {root / 'validation'}: 7 of 277 ")


def test_run_refuses_an_overlap_before_anything_starts(digits_dir, tmp_path, capsys):
    root = leaky_copy(digits_dir, tmp_path, leaked=3)
    study = write_study(root, tmp_path)
    assert main(["run", study]) != 0
    assert "3 of 273 validation examples" in capsys.readouterr().err
    assert not (tmp_path / "storage").exists()  # refused before the storage was touched


def test_an_allowed_overlap_is_a_warning_with_the_count(digits_dir, tmp_path, capsys):
    root = leaky_copy(digits_dir, tmp_path, leaked=5)
    study = write_study(root, tmp_path, allow_overlap=True)
    assert main(["validate", "--data", study]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("ok:")
    assert "warning:" in out.err and "5 of 275 validation examples" in out.err
    assert f"playbook: warning: data.validation: {root / 'validation'}: 5 of 275 " in out.err


def test_disjoint_splits_pass(digits_dir, tmp_path):
    assert main(["validate", "--data", write_study(digits_dir, tmp_path)]) == 0


def test_a_large_split_is_sampled_and_the_count_estimated(tmp_path, monkeypatch):
    """4,000 training rows in 40 row groups, 1,000 of whose ids are also among 2,000 validation
    rows. Splits of up to 3,000 rows read whole, 2,000 rows sampled of larger ones: half the
    training row groups are read, and the hits, doubled, estimate the 1,000."""
    rng = np.random.default_rng(1)
    train_ids = rng.permutation(4000)
    (tmp_path / "train").mkdir()
    pq.write_table(pa.table({"example_id": train_ids}), tmp_path / "train" / "a.parquet", row_group_size=100)
    val_ids = np.concatenate([rng.choice(train_ids, 1000, replace=False), np.arange(10_000, 11_000)])
    (tmp_path / "val").mkdir()
    pq.write_table(pa.table({"example_id": val_ids}), tmp_path / "val" / "a.parquet")
    monkeypatch.setattr(overlap, "EXACT_ROWS", 3000)  # the validation split is read whole
    monkeypatch.setattr(overlap, "SAMPLE_ROWS", 2000)

    train = overlap.read_ids(list_files(str(tmp_path / "train")), "example_id")
    val = overlap.read_ids(list_files(str(tmp_path / "val")), "example_id")
    assert (train.rows_read, train.rows, val.rows_read) == (2000, 4000, 2000)
    assert set(train.ids) < set(train_ids)  # a sample of the rows
    found = overlap.overlap(train, val)
    hits = len(set(train.ids) & set(val_ids))
    assert found.count == hits * 2 and 700 <= found.count <= 1300
    text = found.describe("validation", "example_id")
    assert text.startswith(f"about {hits * 2:,} of 2,000 validation examples")
    assert "from the ids of 2,000 of 4,000 training and 2,000 of 2,000 validation rows" in text
