"""A crash in the middle of writing or copying a checkpoint: the torn directory is refused by the
loader, never picked to resume from, and the resumed run ends bitwise equal to an uninterrupted one;
a damaged state.pt is refused too, and the manifest's digests are those of the bytes on disk."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zlib

import pytest
import torch

from service.core.errors import CheckpointError
from service.distributed import checkpoint
from service.distributed.topology import Topology
from service.trainer.loop import train
from tests.helpers.studies import same_nested
from tests.helpers.trainer_runs import make_plan, read_log, without_timing

WORKLOAD = "tests.helpers.rng_workloads:DropoutDigits"  # consumes the RNG: resume must restore it
STEPS, EVERY = 70, 30  # checkpoints at steps 30, 60, 70


class Crash(Exception):
    """The worker process dies here."""


class StorageReporter:
    """Persists each reported checkpoint the way Ray Train does: a copy of the reported
    directory, file by file, into `store/checkpoint_<n>`. With `cut=(report, files)` the copy of
    that report stops after `files` files, the last of them half written, and the worker dies."""

    def __init__(self, store, cut: tuple[int, int] | None = None, order=sorted):
        self.store, self.cut, self.order = store, cut, order
        self.reports: list[dict] = []
        os.makedirs(store, exist_ok=True)

    def report(self, metrics, checkpoint_dir):
        index = len(self.reports)
        self.reports.append(metrics)
        if checkpoint_dir is None:
            return
        target = os.path.join(self.store, f"checkpoint_{len(os.listdir(self.store)):06d}")
        os.makedirs(target)
        names = self.order(os.listdir(checkpoint_dir))
        for i, name in enumerate(names):
            src, dst = os.path.join(checkpoint_dir, name), os.path.join(target, name)
            if self.cut == (index, i + 1):
                with open(src, "rb") as f, open(dst, "wb") as g:
                    data = f.read()
                    g.write(data[: len(data) // 2])
                raise Crash
            shutil.copyfile(src, dst)

    def restore(self):
        dirs = [os.path.join(self.store, d) for d in os.listdir(self.store)]
        newest = checkpoint.latest_complete(dirs)
        return checkpoint.load(newest) if newest else None


@pytest.fixture(scope="module")
def uninterrupted(digits_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    plan = make_plan(
        digits_dir, tmp / "storage", workload=WORKLOAD, max_train_steps=STEPS, eval_every_steps=EVERY
    )
    reporter = StorageReporter(tmp / "store")
    train(plan, Topology(), reporter)
    final = checkpoint.load(os.path.join(tmp / "store", "checkpoint_000002"))
    assert final.step == STEPS
    return plan, reporter, final


def reverse(names):
    return sorted(names, reverse=True)


@pytest.mark.parametrize(
    "files_copied,order",
    [(1, sorted), (2, sorted), (3, sorted), (1, reverse), (3, reverse)],
    ids=["manifest-only", "manifest+meta", "state-half", "state-half-first", "manifest-half-last"],
)
def test_a_torn_checkpoint_is_never_resumed_from(uninterrupted, digits_dir, tmp_path, files_copied, order):
    ref_plan, ref, ref_final = uninterrupted
    plan = make_plan(
        digits_dir, tmp_path / "storage", workload=WORKLOAD, max_train_steps=STEPS, eval_every_steps=EVERY
    )
    store = tmp_path / "store"
    # The step-60 checkpoint (report 1) is cut off while being copied to storage.
    with pytest.raises(Crash):
        train(plan, Topology(), StorageReporter(store, cut=(1, files_copied), order=order))
    torn = os.path.join(store, "checkpoint_000001")
    assert os.path.isdir(torn)
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        checkpoint.load(torn)

    # A new process (another global RNG state) restarts from the newest *committed* checkpoint.
    torch.manual_seed(999)
    restarted = StorageReporter(store)
    assert restarted.restore().step == 30
    train(plan, Topology(), restarted)
    assert [m["step"] for m in restarted.reports] == [60, 70]
    assert [without_timing(r) for r in read_log(plan)] == [without_timing(r) for r in read_log(ref_plan)]
    final = checkpoint.load(checkpoint.latest_complete([os.path.join(store, d) for d in os.listdir(store)]))
    assert final.step == STEPS
    for key in ref_final.model:
        assert torch.equal(final.model[key], ref_final.model[key]), key
    for pid, state in ref_final.optimizer["state"].items():
        for name, value in state.items():
            assert torch.equal(value, final.optimizer["state"][pid][name]), (pid, name)
    assert same_nested(final.rng_states, ref_final.rng_states)


def test_a_checkpoint_whose_files_were_mixed_is_refused(uninterrupted, tmp_path):
    """Whole files, but not the ones committed together (a state.pt from another step)."""
    _, ref, _ = uninterrupted
    store = ref.store
    mixed = tmp_path / "mixed"
    shutil.copytree(os.path.join(store, "checkpoint_000002"), mixed)
    shutil.copyfile(
        os.path.join(store, "checkpoint_000000", checkpoint.STATE_FILE), mixed / checkpoint.STATE_FILE
    )
    with pytest.raises(CheckpointError, match="state.pt does not match manifest.json"):
        checkpoint.load(str(mixed))
    assert checkpoint.latest_complete([str(mixed), os.path.join(store, "checkpoint_000000")]).endswith("0000")


def test_a_torn_latest_checkpoint_on_object_storage_falls_back_to_the_newest_committed(tmp_path):
    """What Ray Train's restore sees on gs://: its storage filesystem is an fsspec filesystem
    wrapped for pyarrow (`storage.ray_storage`); here fsspec's memory:// behind the same wrapper.
    Checkpoints 10 and 20 are whole, 30 lost its manifest and half its state.pt (a cut copy)."""
    import pyarrow.fs as pafs

    from service.core import storage
    from service.orchestration import launch

    root = "memory://torn-fallback/trial"
    fs, _ = storage.split(root)
    states = {}
    for step in (10, 20, 30):
        states[step] = checkpoint.TrialState(step, {"w": torch.full((3,), float(step))}, {}, [], [], {})
        local = tmp_path / f"c{step}"
        checkpoint.save(states[step], str(local), {"step": step})
        for name in os.listdir(local):
            fs.pipe(f"/torn-fallback/trial/checkpoint_{step:06d}/{name}", (local / name).read_bytes())
    fs.rm("/torn-fallback/trial/checkpoint_000030/" + checkpoint.MANIFEST_FILE)
    state_file = "/torn-fallback/trial/checkpoint_000030/" + checkpoint.STATE_FILE
    fs.pipe(state_file, fs.cat(state_file)[:100])

    wrapped, path = storage.ray_storage(root)
    where, state = launch.newest_committed_sibling(wrapped, f"{path}/checkpoint_000030")
    assert where.rstrip("/").endswith("checkpoint_000020") and state.step == 20
    assert torch.equal(state.model["w"], states[20].model["w"])

    fs.rm("/torn-fallback/trial/checkpoint_000010", recursive=True)  # no committed one but 20
    fs.rm("/torn-fallback/trial/checkpoint_000020/" + checkpoint.MANIFEST_FILE)
    assert launch.newest_committed_sibling(wrapped, f"{path}/checkpoint_000030") is None
    assert isinstance(wrapped, pafs.PyFileSystem)


def saved_state(directory) -> checkpoint.TrialState:
    # One tensor above OVERLAP_MIN_BYTES (checksummed on the helper thread), one below.
    weights = {"w": torch.arange(400_000, dtype=torch.float32), "b": torch.arange(10.0)}
    assert weights["w"].nbytes > checkpoint.OVERLAP_MIN_BYTES > weights["b"].nbytes
    state = checkpoint.TrialState(7, weights, {}, [], [{"step": 7}], {})
    checkpoint.save(state, str(directory), {"step": 7})
    return state


def test_the_manifest_holds_the_size_and_crc32_of_the_bytes_on_disk(tmp_path):
    state = saved_state(tmp_path)
    manifest = json.loads((tmp_path / checkpoint.MANIFEST_FILE).read_text())
    for name in (checkpoint.STATE_FILE, checkpoint.META_FILE):
        data = (tmp_path / name).read_bytes()
        assert manifest["files"][name] == {"size": len(data), "crc32": zlib.crc32(data)}, name
    loaded = checkpoint.load(str(tmp_path))
    assert all(loaded.model[k].equal(v) for k, v in state.model.items())
    # torch.save's own zip CRCs are switched off for the checkpoint only, not for the caller.
    assert torch.serialization.get_crc32_options()


@pytest.mark.parametrize("damage", ["flipped-byte", "truncated", "appended"])
def test_a_damaged_state_file_is_refused(tmp_path, damage):
    saved_state(tmp_path)
    path = tmp_path / checkpoint.STATE_FILE
    data = bytearray(path.read_bytes())
    if damage == "flipped-byte":
        data[len(data) // 2] ^= 0x01  # inside the tensor's bytes: torch.load alone would not notice
    elif damage == "truncated":
        data = data[:-1]
    else:
        data += b"\0"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="state.pt does not match manifest.json"):
        checkpoint.load(str(tmp_path))
    assert checkpoint.latest_complete([str(tmp_path)]) is None


def test_a_format_1_manifest_with_sha256_digests_is_still_read(tmp_path):
    """Checkpoints written before the manifest switched to CRC-32 still resume."""
    state = saved_state(tmp_path)
    files = {}
    for name in (checkpoint.STATE_FILE, checkpoint.META_FILE):
        data = (tmp_path / name).read_bytes()
        files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (tmp_path / checkpoint.MANIFEST_FILE).write_text(json.dumps({"format": 1, "files": files}))
    assert checkpoint.load(str(tmp_path)).model["w"].equal(state.model["w"])
    files[checkpoint.STATE_FILE]["sha256"] = hashlib.sha256(b"another state").hexdigest()
    (tmp_path / checkpoint.MANIFEST_FILE).write_text(json.dumps({"format": 1, "files": files}))
    with pytest.raises(CheckpointError, match="state.pt does not match manifest.json"):
        checkpoint.load(str(tmp_path))
    (tmp_path / checkpoint.MANIFEST_FILE).write_text(json.dumps({"format": 99, "files": files}))
    with pytest.raises(CheckpointError, match="no valid manifest.json"):
        checkpoint.load(str(tmp_path))
