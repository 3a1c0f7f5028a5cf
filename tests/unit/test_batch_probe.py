"""The batch-size probe on CPU (`trainer.batch_probe`): it trains the study's digits model on
the study's training files at each power of two up to --max; a size past a real memory limit
(an address-space limit on a subprocess) does not fit, and the probe goes on after it; the
command's bad options are refused in one line before anything starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import yaml

from service.analysis.batch_size import probe_sizes
from service.cli import main
from service.data import files
from service.data.files import list_files
from service.trainer.batch_probe import MIN_BLOCKS, measure, probe_study
from tests.helpers.studies import make_study, study_dict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_probe_trains_each_power_of_two_up_to_max_on_the_study_data(digits_dir, tmp_path):
    study = make_study(digits_dir, tmp_path / "store")
    sizes = probe_sizes(8, 32, study)
    opened_before = len(files.OPENED)
    start = time.perf_counter()
    rows = [measure(study, size, "cpu", steps=2, warmup=1, min_seconds=0) for size in sizes]
    wall_s = time.perf_counter() - start
    assert [r.per_worker_batch for r in rows] == [8, 16, 32]
    for r in rows:
        assert r.fits and r.error is None and r.device.startswith("cpu")
        assert r.examples_per_s > 0 and r.examples_per_s == pytest.approx(r.per_worker_batch / r.step_s)
        assert r.peak_memory_bytes is None  # not measured on CPU
    # Each size timed at least MIN_BLOCKS blocks of 2 steps, all inside this wall-clock time.
    assert wall_s >= sum(MIN_BLOCKS * 2 * r.step_s for r in rows)
    # The study's own training files were read; nothing was written to its storage.
    train_uris = {f.uri for f in list_files(study.data.train)}
    assert train_uris <= set(files.OPENED[opened_before:])
    assert not (tmp_path / "store").exists()


def test_the_probe_trains_the_whole_per_worker_batch_on_one_worker(digits_dir, tmp_path):
    """Microbatches (gradient accumulation) save memory, not time: the probe drops them, and
    a size they would not divide still trains."""
    study = make_study(
        digits_dir,
        tmp_path,
        scaling={"num_hosts": 1, "workers_per_host": 2},
        training={"batch_size": 32, "microbatch_size": 8, "eval_batch_size": 32},
    )
    probed = probe_study(study, 4)
    assert probed.training.batch_size == 4 and probed.training.microbatch_size is None
    assert probed.scaling.world_size == 1 and probed.training.eval_batch_size is None
    assert measure(study, 4, "cpu", steps=1, warmup=1, min_seconds=0).fits


BALLAST_MIB = 8
HEADROOM_MIB = 384
"""The subprocess may take this much more address space than it holds after a first probe:
32 rows of 8 MiB (256 MiB) fit, 64 rows (512 MiB) do not."""

OUT_OF_MEMORY_SCRIPT = """
import json, resource, sys
import torch
from service.orchestration.batch_probe_task import probe_sizes
from service.study import spec
from service.trainer.batch_probe import measure

torch.set_num_threads(1)
study = spec.load_file(sys.argv[1])
probe = lambda size: measure(study, size, "cpu", steps=1, warmup=1, min_seconds=0)
probe(8)  # every library loaded, the allocator warm
size_kb = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize"))
limit = size_kb * 1024 + int(sys.argv[2]) * 2**20
resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
rows = probe_sizes(probe, [8, 16, 32, 64, 128], min_gain=-1.0)  # stops only where memory does
after = probe(16)
print(json.dumps([[r.per_worker_batch, r.fits, r.error] for r in rows + [after]]))
"""


def test_a_size_past_the_memory_limit_does_not_fit_and_the_probe_recovers(digits_dir, tmp_path):
    d = study_dict(digits_dir, tmp_path / "store", workload="tests.helpers.ballast_workload:BallastDigits")
    d["search"]["ballast_mib"] = {"role": "fixed", "value": BALLAST_MIB}
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(d))
    # One malloc arena per thread would reserve address space of its own: the limit would move.
    env = {**os.environ, "PYTHONPATH": ROOT, "MALLOC_ARENA_MAX": "2"}
    out = subprocess.run(
        [sys.executable, "-c", OUT_OF_MEMORY_SCRIPT, str(tmp_path / "study.yaml"), str(HEADROOM_MIB)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.splitlines()[-1])
    assert [(size, fits) for size, fits, _ in rows] == [
        (8, True),
        (16, True),
        (32, True),
        (64, False),
        (16, True),
    ]
    assert "can't allocate memory" in rows[3][2]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--max", "100"], "--max: must be a power of two (got 100)"),
        (["--min", "64", "--max", "32"], "--min: must be <= --max (64 > 32)"),
        (["--steps", "0"], "--steps: must be >= 1 (got 0)"),
        (["--min-gain", "1.5"], "--min-gain: must be in [0, 1) (got 1.5)"),
    ],
)
def test_bad_options_are_one_line_and_nothing_starts(digits_dir, tmp_path, capsys, args, message):
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(study_dict(digits_dir, tmp_path / "store")))
    code = main(["find-batch-size", str(tmp_path / "study.yaml"), *args])
    out, err = capsys.readouterr()
    assert (code, out, err) == (2, "", f"playbook: error: {message}\n")
    assert not (tmp_path / "store").exists()


def test_a_missing_study_file_is_named(tmp_path, capsys):
    code = main(["find-batch-size", str(tmp_path / "nope.yaml")])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.startswith(f"playbook: error: {tmp_path / 'nope.yaml'}: ")
