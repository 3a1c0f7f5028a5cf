"""4. One training step: the schedule's learning rate, the next batch, forward and backward over
its microbatches (`training.microbatch_size`, DDP all-reducing once, after the last one) under
the trial's precision, the gradients' global norm (and clipping), the update. Nothing is read
back to the host inside the step."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator

import torch

from service.core.errors import SpecError
from service.data.loader import Batch
from service.distributed.sharding import no_gradient_sync
from service.trainer.profiling import StepProfiler
from service.trainer.setup import Progress, TrialContext


def train_step(
    ctx: TrialContext, progress: Progress, batches: Iterator[Batch], profiler: StepProfiler
) -> None:
    """One optimizer update. The loss goes to the interval's tally on the device."""
    progress.lr = ctx.plan.learning_rate(progress.step)
    for group in ctx.optimizer.param_groups:
        group["lr"] = progress.lr
    ctx.rank0.run(profiler.before_step, progress.step)
    ctx.timer.begin_step()
    if ctx.sync_debug:
        torch.cuda.set_sync_debug_mode(ctx.sync_debug)
    batch = {k: v.to(ctx.device, non_blocking=True) for k, v in next(batches).items()}
    ctx.timer.got_batch()
    if progress.interval_start is None:
        progress.interval_start = time.perf_counter()
    ctx.gradients.zero(ctx.optimizer)
    loss = forward_backward(ctx, batch)
    ctx.gradients.settle()
    if ctx.unchecked_gradients:
        check_every_gradient(ctx)
    update(ctx)
    progress.step += 1
    progress.steps_in_interval += 1
    ctx.tally.add(loss, progress.step)
    if ctx.sync_debug:
        torch.cuda.set_sync_debug_mode("default")
    ctx.timer.end_step()
    ctx.rank0.run(profiler.after_step, progress.step)


def check_every_gradient(ctx: TrialContext) -> None:
    """Once per trial on each rank, after its first backward: DDP without `scaling.find_unused_parameters`
    cannot reduce a step that leaves a parameter without a gradient (the step's update would use
    gradients that were never all-reduced, and the next forward pass fails with DDP's own
    error). One line naming the field and the parameters instead, not retried."""
    ctx.unchecked_gradients = False
    missing = [name for name, p in ctx.model.named_parameters() if p.requires_grad and p.grad is None]
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise SpecError(
            f"scaling.find_unused_parameters: a training step left parameters of the model without a "
            f"gradient ({shown}); set it to true for a model whose steps do not use every parameter"
        )


def microbatches(batch: Batch, size: int | None) -> list[Batch]:
    """The batch cut along its first dimension into consecutive parts of `size` rows (the
    whole batch when `size` is None)."""
    if size is None:
        return [batch]
    rows = len(next(iter(batch.values())))
    return [{k: v[i : i + size] for k, v in batch.items()} for i in range(0, rows, size)]


def forward_backward(ctx: TrialContext, batch: Batch) -> torch.Tensor:
    """The gradients of the batch's mean loss, accumulated over its microbatches: each
    microbatch's mean loss times its share of the batch (`microbatch_shares`), so that the sum
    is the batch's mean. DDP and FSDP reduce the gradients only on the last microbatch (`no_gradient_sync`).
    Returns the batch's mean loss, detached, on the device."""
    parts = microbatches(batch, ctx.microbatch_size)
    shares = microbatch_shares(ctx.workload, batch, parts)
    total = None
    for i, (part, share) in enumerate(zip(parts, shares, strict=True)):
        last = i == len(parts) - 1
        with contextlib.nullcontext() if last else no_gradient_sync(ctx.trained):
            with ctx.precision.autocast():
                loss = ctx.workload.loss(ctx.workload.forward(ctx.trained, part), part).mean()
            if share is not None:
                loss = loss * share
            ctx.precision.backward(loss)
        total = loss.detach() if total is None else total + loss.detach()
    return total


def microbatch_shares(workload, batch: Batch, parts: list[Batch]) -> list:
    """Each microbatch's share of the batch's mean loss: 1 / their number for a loss averaged
    over rows, its part of `Workload.loss_weight` otherwise (device scalars: no host sync).
    None for a batch taken whole."""
    if len(parts) == 1:
        return [None]
    whole = workload.loss_weight(batch)
    if whole is None:
        return [1.0 / len(parts)] * len(parts)
    return [workload.loss_weight(part) / whole for part in parts]


def update(ctx: TrialContext) -> None:
    """The gradients' global norm to the tally (after DDP's all-reduce, so the same on every
    rank; unscaled first under fp16, as the scaler's step would), clipped to `grad_clip_norm`
    when it is set, then the step. Without clipping the norm is still taken (the clipping
    verdict suggests a threshold from it) and nothing is clipped."""
    ctx.precision.unscale(ctx.optimizer)
    if ctx.clip_norm is None:
        ctx.tally.add_grad_norm(ctx.gradients.norm(), math.inf)
    else:
        ctx.tally.add_grad_norm(ctx.gradients.clip(ctx.clip_norm), ctx.clip_norm)
    ctx.precision.step(ctx.optimizer)
