"""A pooled trial's process starts its pool's actors before it imports the trainer
(`tune_run.tune_trial`), so that they start and import while it imports: what it runs until
then must not import torch."""

from __future__ import annotations

import subprocess
import sys


def test_a_trial_process_starts_its_pool_before_importing_torch():
    code = (
        "import sys, service.orchestration.tune_run, service.orchestration.worker_pool; "
        "print(sorted(m for m in ('torch', 'service.trainer.loop', 'service.orchestration.launch') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
