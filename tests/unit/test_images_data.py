"""`playbook data images`: the generated image data set (service/data/images.py)."""

from __future__ import annotations

import hashlib
import io
import os

import numpy as np
import pyarrow.parquet as pq
from PIL import Image
from sklearn.datasets import load_digits

from service import cli
from service.data import images

COUNT = 120


def file_hashes(root) -> dict[str, str]:
    out = {}
    for split in images.SPLITS:
        for name in sorted(os.listdir(root / split)):
            out[f"{split}/{name}"] = hashlib.sha256((root / split / name).read_bytes()).hexdigest()
    return out


def test_same_seed_same_bytes_other_seed_other_images(tmp_path):
    images.write_images(str(tmp_path / "a"), COUNT, seed=5)
    images.write_images(str(tmp_path / "b"), COUNT, seed=5)
    images.write_images(str(tmp_path / "c"), COUNT, seed=6)
    a, b, c = (file_hashes(tmp_path / x) for x in "abc")
    assert a == b
    assert len(a) == 12 and set(a) == set(c)
    assert not set(a.values()) & set(c.values())


def test_labels_ids_and_splits(tmp_path):
    images.write_images(str(tmp_path), COUNT, seed=1)
    targets = load_digits().target
    tables = {s: pq.read_table(tmp_path / s) for s in images.SPLITS}
    assert {s: t.num_rows for s, t in tables.items()} == {"train": 96, "validation": 12, "test": 12}
    ids = np.concatenate([t.column("example_id").to_numpy() for t in tables.values()])
    assert sorted(ids) == list(range(COUNT))
    sources = {}
    for split, t in tables.items():
        src = t.column("source_digit").to_numpy()
        assert (t.column("label").to_numpy() == targets[src]).all()  # the label is the digit drawn
        sources[split] = set(src.tolist())
    # No source digit in two splits.
    assert not sources["train"] & sources["validation"]
    assert not sources["train"] & sources["test"]
    assert not sources["validation"] & sources["test"]
    assert len(set(tables["train"].column("label").to_pylist())) == 10


def test_png_decodes_to_the_generated_array(tmp_path):
    seed = 2
    images.write_images(str(tmp_path), COUNT, seed=seed)
    first = pq.read_table(tmp_path / "train" / "part-00000.parquet")
    decoded = np.stack([np.asarray(Image.open(io.BytesIO(b))) for b in first.column("png").to_pylist()])
    assert decoded.shape == (first.num_rows, 32, 32, 3) and decoded.dtype == np.uint8
    # The same draws again, in the generator's order (split 1 = train, file 0): lossless PNG.
    glyphs, _ = images.source_digits()
    pool = images.split_sources(len(glyphs), seed)["train"]
    rng = np.random.default_rng([seed, 1, 0])
    chosen = rng.choice(pool, first.num_rows)
    np.testing.assert_array_equal(first.column("source_digit").to_numpy(), chosen)
    np.testing.assert_array_equal(decoded, images.compose(rng, glyphs[chosen]))
    # Real structure: the ink contrasts with its background, so images are far from flat.
    assert decoded.reshape(len(decoded), -1).std(axis=1).min() > 10


def test_cli_writes_it_and_refuses_a_bad_count(tmp_path, capsys):
    assert cli.main(["data", "images", str(tmp_path / "ok"), "--count", "40", "--seed", "3"]) == 0
    assert pq.read_table(tmp_path / "ok" / "train").num_rows == 32
    assert cli.main(["data", "images", str(tmp_path / "bad"), "--count", "5"]) == 2
    assert capsys.readouterr().err.strip() == "playbook: error: --count: at least 30 images (got 5)"
    assert not (tmp_path / "bad").exists()
    assert cli.main(["data", "digits", str(tmp_path / "d"), "--count", "5"]) == 2
