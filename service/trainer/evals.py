"""What one eval point evaluates: the validation set (or its fixed sample, with the full set and
the sample's bias at the end and every full_eval_every_steps) and the training sample evaluated
like validation; rank 0 writes each pass's predictions."""

from __future__ import annotations

from service.data.loader import eval_batches
from service.evaluation import predictions as prediction_files
from service.evaluation.predictions import PredictionLog
from service.evaluation.run import evaluate
from service.evaluation.sampling import bias_fields, is_full_eval
from service.trainer.setup import TrialContext


def train_eval_fields(ctx: TrialContext) -> dict:
    """The training sample evaluated exactly like validation (eval mode, padded batches,
    weighted sums over all ranks): `train_eval/<metric>`."""
    ranges, keep = ctx.evals.train_part
    size = ctx.evals.batch_size
    batches = eval_batches(ctx.workload, ranges, size, keep)
    with ctx.precision.autocast():
        result = evaluate(ctx.model, ctx.workload, batches, size, ctx.device)
    return {f"train_eval/{k}": v for k, v in result.items() if k != "per_class"}


def run_evals(ctx: TrialContext, step: int) -> dict:
    """The evaluations of one eval point: the full validation set, or its fixed sample plus
    (at the end and every full_eval_every_steps) the full set and the sample's bias."""
    sample = ctx.evals.sample
    if sample is None:
        return validation_pass(ctx, step, None, "validation", "validation")[0]
    fields, _ = validation_pass(ctx, step, sample.local_keep, "validation-sample", "validation")
    if is_full_eval(step, ctx.max_steps, ctx.training):
        full, rows = validation_pass(ctx, step, None, "validation", "validation_full")
        fields.update(full)
        if rows is not None:  # rank 0
            fields.update(sample_bias_fields(ctx, rows, step))
    return fields


def validation_pass(ctx: TrialContext, step: int, keep, split: str, prefix: str) -> tuple[dict, dict | None]:
    """One pass over this rank's validation rows (`keep`: the sample's positions, or None for
    all) with its predictions written by rank 0: (`<prefix>/<metric>` fields, the gathered
    predictions on rank 0, else None)."""
    workload, size = ctx.workload, ctx.evals.batch_size
    log = PredictionLog.of(workload)
    batches = eval_batches(workload, ctx.evals.val_ranges, size, keep)
    with ctx.precision.autocast():  # as in training; the metrics are still summed in float64
        val = evaluate(ctx.model, workload, batches, size, ctx.device, log)
    rows = log.gather()
    ctx.rank0.run(write_predictions, ctx.plan.predictions_uri(split, step), rows, split, step)
    return {f"{prefix}/{k}": v for k, v in val.items()}, rows


def sample_bias_fields(ctx: TrialContext, rows: dict, step: int) -> dict:
    """The validation sample's gap to the full set (`validation_full/sample_*`), with a warning
    when it is larger than sampling noise explains."""
    tr = ctx.training
    bias = bias_fields(rows, ctx.evals.sample, tr.metric.split("/", 1)[1])
    if bias["sample_biased"]:
        print(
            f"[{ctx.plan.trial_name}] warning: the validation sample is biased at step {step}: "
            f"{tr.metric} sample - full = {bias['sample_gap']:+.4g}, more than sampling "
            f"noise explains (95% CI [{bias['sample_gap_ci_low']:+.4g}, "
            f"{bias['sample_gap_ci_high']:+.4g}])",
            flush=True,
        )
    return {f"validation_full/{k}": v for k, v in bias.items()}


def write_predictions(uri: str, rows: dict, split: str, step: int) -> None:
    prediction_files.write(uri, rows, split, step)
