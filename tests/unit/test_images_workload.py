"""The `images` workload: PNG decoding online, augmentation (crop with padding + flip) recomputed
by hand with PIL for given steps, the batch of a step a pure function of it, no augmentation at
evaluation, decoding moved offline by `playbook preprocess`, and the input-bound verdict."""

from __future__ import annotations

import io
import itertools

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image, ImageOps

from service import cli, workloads
from service.analysis.input_bound import InputTotals, likely_cause
from service.core.errors import DataError
from service.data.files import list_files
from service.data.images import write_images
from service.data.loader import TrainStream, eval_batches
from service.data.process_input import process_source
from service.data.sharding import RowRange
from service.distributed import checkpoint
from service.distributed.topology import Topology
from service.trainer.loop import train
from tests.helpers.trainer_runs import Interrupted, Reporter, make_plan, without_timing

SEED, BATCH, PAD = 987654321, 10, 4
MASK, GOLDEN = 2**64 - 1, 0x9E3779B97F4A7C15


def splitmix(x: int) -> int:
    """splitmix64's finaliser in Python integers (the augmentation's documented hash)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def hand_draws(seed: int, epoch: int, example_id: int) -> tuple[int, int, bool]:
    h = splitmix((seed + GOLDEN) & MASK)
    h = splitmix(((h ^ epoch) + GOLDEN) & MASK)
    h = splitmix(((h ^ example_id) + GOLDEN) & MASK)
    return h % 9, (h >> 32) % 9, bool(h >> 63)


def hand_augment(png: bytes, dy: int, dx: int, flip: bool) -> np.ndarray:
    """PIL: pad by 4 black pixels, cut 32x32 at (dx, dy), mirror; as [3, 32, 32]."""
    image = ImageOps.expand(Image.open(io.BytesIO(png)), border=PAD, fill=(0, 0, 0))
    image = image.crop((dx, dy, dx + 32, dy + 32))
    if flip:
        image = ImageOps.mirror(image)
    return np.asarray(image).transpose(2, 0, 1)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    write_images(str(root), 60, seed=0)  # 48 training images in 8 files
    return root


def rows_by_id(directory) -> dict[int, tuple[bytes, int]]:
    t = pq.read_table(directory)
    ids, pngs, labels = (t.column(c).to_pylist() for c in ("example_id", "png", "label"))
    return {i: (p, y) for i, p, y in zip(ids, pngs, labels, strict=True)}


def stream_of(directory, workload="images", **hparams) -> TrainStream:
    ranges = [RowRange(f, 0, f.num_rows) for f in list_files(str(directory))]
    return TrainStream(workloads.get(workload), ranges, BATCH, SEED, 4, hparams=hparams)


def test_training_batches_are_the_pngs_cropped_and_flipped_by_hand(data):
    raw = rows_by_id(data / "train")
    stream = stream_of(data / "train")
    assert stream.num_examples == 48
    offsets, flips, by_epoch = set(), 0, {}
    for step in (0, 3, 4, 7):  # step 4 holds rows 40..49: the end of epoch 0, the start of epoch 1
        batch = stream.batch(step)
        assert batch["features"].dtype == torch.uint8
        for k, example_id in enumerate(batch["example_id"].tolist()):
            epoch = (step * BATCH + k) // 48
            dy, dx, flip = hand_draws(SEED, epoch, example_id)
            png, label = raw[example_id]
            np.testing.assert_array_equal(batch["features"][k].numpy(), hand_augment(png, dy, dx, flip))
            assert batch["label"][k] == label
            offsets.add((dy, dx))
            flips += flip
            by_epoch.setdefault(example_id, set()).add((epoch, dy, dx, flip))
    assert len(offsets) > 5 and 0 < flips < 40  # it really augments
    assert any(len(v) == 2 for v in by_epoch.values())  # an image seen in both epochs, cut differently


def test_the_batch_of_a_step_is_a_pure_function_of_the_step(data):
    stream = stream_of(data / "train")
    run = list(itertools.islice(stream.iterate(0), 12))
    for step in (0, 5, 11):
        for other in (stream.batch(step), next(stream.iterate(step))):
            for key in ("features", "example_id", "label"):
                assert torch.equal(run[step][key], other[key])
    # In input worker processes (the stream and the trial's hyperparameters pickled to them).
    served = list(itertools.islice(process_source(1)(stream, 5), 3))
    for i, batch in enumerate(served):
        assert torch.equal(batch["features"], run[5 + i]["features"])


def test_no_augmentation_at_evaluation_or_when_switched_off(data):
    raw = rows_by_id(data / "validation")
    ranges = [RowRange(f, 0, f.num_rows) for f in list_files(str(data / "validation"))]
    batches = list(eval_batches(workloads.get("images"), ranges, 5))
    ids = torch.cat([b["example_id"] for b in batches]).tolist()
    assert sorted(ids) == sorted(raw) and len(ids) == 6
    features = torch.cat([b["features"] for b in batches])
    for k, example_id in enumerate(ids):
        plain = np.asarray(Image.open(io.BytesIO(raw[example_id][0]))).transpose(2, 0, 1)
        np.testing.assert_array_equal(features[k].numpy(), plain)
    off = stream_of(data / "train", augment=False).batch(2)
    train_raw = rows_by_id(data / "train")
    for k, example_id in enumerate(off["example_id"].tolist()):
        plain = np.asarray(Image.open(io.BytesIO(train_raw[example_id][0]))).transpose(2, 0, 1)
        np.testing.assert_array_equal(off["features"][k].numpy(), plain)


def test_preprocess_moves_decoding_offline_and_augmentation_stays_online(data, tmp_path, capsys):
    dest = tmp_path / "decoded"
    argv = ["preprocess", str(data / "train"), str(dest), "--workload", "images_decoded", "--num-files", "2"]
    assert cli.main(argv) == 0
    decoded = pq.read_table(dest)
    assert decoded.column_names == ["example_id", "pixels", "label"]
    raw = rows_by_id(data / "train")
    columns = [decoded.column(c).to_pylist() for c in decoded.column_names]
    for example_id, pixels, label in zip(*columns, strict=True):
        png, raw_label = raw[example_id]
        plain = np.asarray(Image.open(io.BytesIO(png))).transpose(2, 0, 1).reshape(-1)
        assert pixels == plain.tolist() and label == raw_label
    # Training on it: the same hand-made augmentation, now from stored pixels (no PNG decoded).
    stream = stream_of(dest, "images_decoded")
    batch = next(stream.iterate(1))  # the training stream: its timings counted
    for k, example_id in enumerate(batch["example_id"].tolist()):
        dy, dx, flip = hand_draws(SEED, 0, example_id)
        np.testing.assert_array_equal(
            batch["features"][k].numpy(), hand_augment(raw[example_id][0], dy, dx, flip)
        )
    read_s, preprocess_s, augment_s = stream.stats.take()
    assert read_s > 0 and preprocess_s > 0 and augment_s > 0  # augmentation time counted apart


def test_a_bad_png_is_named_with_its_file_and_row(tmp_path):
    write_images(str(tmp_path), 40, seed=1)
    path = tmp_path / "validation" / "part-00001.parquet"
    t = pq.read_table(path)
    pngs = t.column("png").to_pylist()
    pngs[1] = b"not a png"
    pq.write_table(t.set_column(1, "png", pa.array(pngs, pa.binary())), path)
    ranges = [RowRange(f, 0, f.num_rows) for f in list_files(str(tmp_path / "validation"))]
    with pytest.raises(DataError) as e:
        list(eval_batches(workloads.get("images"), ranges, 4))
    assert str(e.value).startswith(
        f"{path}: column 'png', row 1: workload images cannot turn it into a batch"
    )


def test_the_input_bound_verdict_names_decoding_and_the_command():
    slow_decode = InputTotals(wait_s=6, step_s=10, read_s=0.5, preprocess_s=5, augment_s=1)
    cause, remedy = likely_cause(slow_decode, False, 2, decoded_workload="images_decoded")
    assert cause == "online_decoding"
    assert "decoding the data in the workload's online preprocessing takes 5 s" in remedy
    assert "`playbook preprocess SRC DEST --workload images_decoded`" in remedy
    assert likely_cause(slow_decode, False, 2)[0] == "online_preprocessing"  # a workload naming none
    slow_augment = InputTotals(wait_s=6, step_s=10, read_s=0.5, preprocess_s=1, augment_s=5)
    cause, remedy = likely_cause(slow_augment, False, 2, decoded_workload="images_decoded")
    assert cause == "online_augmentation" and "cannot move offline" in remedy
    cause, remedy = likely_cause(slow_decode, False, 2, "processes", decoded_workload="images_decoded")
    assert cause == "input_workers" and "--workload images_decoded" in remedy
    history = [{"input/step_s": 4.0, "input/augment_s": 0.25}, {"input/step_s": 6.0, "input/augment_s": 0.5}]
    assert InputTotals.from_history(history).augment_s == 0.75


def test_an_interrupted_trial_resumes_bitwise_with_online_augmentation(data, tmp_path):
    """Stopped at its first eval point (step 4) and resumed from that checkpoint, over an epoch
    boundary (48 images, 8 a step): the same metrics and final weights, to the bit."""
    hp = {"learning_rate": 0.05, "momentum": 0.9, "width": 4, "stages": 1}

    def run(storage, store, **kw) -> Reporter:
        plan = make_plan(
            data, storage, hparams=hp, workload="images", max_train_steps=8, eval_every_steps=4, batch_size=8
        )
        reporter = Reporter(store, **kw)
        try:
            train(plan, Topology(), reporter)
        except Interrupted:
            pass
        return reporter

    whole = run(tmp_path / "a", tmp_path / "wa")
    first = run(tmp_path / "b", tmp_path / "wb", stop_after=1)
    rest = run(tmp_path / "b", tmp_path / "wc", restore_state=checkpoint.load(first.reports[-1][1]))
    resumed = [without_timing(m) for m in first.metrics + rest.metrics]
    assert resumed == [without_timing(m) for m in whole.metrics]
    a, b = (checkpoint.load(r.reports[-1][1]).model for r in (whole, rest))
    assert all(torch.equal(v, b[k]) for k, v in a.items())
