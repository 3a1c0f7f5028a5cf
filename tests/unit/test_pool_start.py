"""A pooled trial's process starts its pool's actors before it imports the trainer
(`tune_run.tune_trial`), so that they start and import while it imports: what it runs until
then must not import torch."""

from __future__ import annotations

from tests.helpers.processes import imported_along


def test_a_trial_process_starts_its_pool_before_importing_torch():
    imports = ["service.orchestration.tune_run", "service.orchestration.worker_pool"]
    trainer = ["torch", "service.trainer.loop", "service.orchestration.launch"]
    assert imported_along(imports, trainer) == []
