"""A short seeded chaos run (`make chaos` runs twenty drawn ones, see tests/helpers/chaos.py):
the two-worker study (on reused workers, the default) run once uninterrupted by `playbook run`
on an embedded Ray, then with a process drawn from a fixed seed SIGKILLed at a drawn moment;
where the command died or failed it is rerun; the results must be bitwise the reference's and
nothing of the run's Ray may be left."""

from __future__ import annotations

import pytest

from tests.helpers import chaos

pytestmark = [pytest.mark.timeout(1200)]
SEEDS = {
    5: "pool_worker"
}  # a death the service heals alone; the command's own (a rerun): test_fault_driver_kill


@pytest.fixture(scope="module")
def reference(digits_dir, tmp_path_factory):
    return chaos.run_reference("pair", str(digits_dir), str(tmp_path_factory.mktemp("reference")))


@pytest.mark.parametrize("seed", sorted(SEEDS), ids=lambda s: f"seed{s}-{SEEDS[s]}")
def test_a_killed_process_leaves_the_results_of_the_uninterrupted_run(reference, digits_dir, tmp_path, seed):
    d = chaos.draw(seed, {"pair": reference})
    assert (d.cls, d.study) == (SEEDS[seed], "pair")  # the seed still draws what it covers
    outcome = chaos.chaos_run(d, str(digits_dir), str(tmp_path), reference)
    print(outcome.line())
    assert outcome.killed_one, outcome.line()
    assert outcome.reran == (d.cls == "driver"), outcome.line()
    assert outcome.equal, outcome.line()
