"""Optional torch-profiler trace of a few training steps (`input.profile_steps`), written by
rank 0 to `trials/<trial>/profile/rank0.trace.json` in the trial's storage: a Chrome trace that
https://ui.perfetto.dev opens, showing where a step waits for input and where it computes."""

from __future__ import annotations

import os
import tempfile

from torch.profiler import ProfilerActivity, profile

from service.core import storage


class StepProfiler:
    """Profiles steps [first_step, first_step + num_steps) of this process, then writes the
    trace to `uri`; on a GPU (`cuda`) with the device's kernels and copies beside the host's
    operations. With num_steps 0 (or not rank 0) it does nothing."""

    def __init__(self, uri: str, num_steps: int, first_step: int, cuda: bool = False):
        self.uri, self.first, self.last = uri, first_step, first_step + num_steps
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self._prof = None

    def before_step(self, step: int) -> None:
        if step == self.first and self.last > self.first:
            self._prof = profile(activities=self.activities, record_shapes=False)
            self._prof.__enter__()

    def after_step(self, step: int) -> None:
        """`step` is the number of steps done."""
        if self._prof is not None and step >= self.last:
            self.close()

    def close(self) -> None:
        """Stop and write the trace of the steps profiled so far (the trial ended, or diverged,
        before the last profiled step); nothing when no profile is running."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        with tempfile.TemporaryDirectory(prefix="playbook-trace-") as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path, "rb") as f:
                storage.write_bytes_atomic(self.uri, f.read())
