"""bench/results.json -> the performance table in docs/performance.md (between the
`<!-- bench:begin -->` and `<!-- bench:end -->` markers), the one place the figures are shown:
`python -m bench.table` rewrites it from results.json alone; `make bench` does after measuring."""

from __future__ import annotations

import json
import os

from bench.common import GOALS

HERE = os.path.dirname(os.path.abspath(__file__))
DOC = os.path.join(os.path.dirname(HERE), "docs", "performance.md")
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
BASELINES = {
    "step_ratio": ("service_steps_per_s", "bare_steps_per_s", "steps/s"),
    "bf16_speedup": ("bf16_steps_per_s", "fp32_steps_per_s", "steps/s"),
    "lm_step_ratio": ("service_tokens_per_s", "bare_tokens_per_s", "tokens/s"),
    "cnn_step_ratio": ("service_images_per_s", "bare_images_per_s", "images/s"),
    "loader_vs_pyarrow": ("service_examples_per_s", "pyarrow_examples_per_s", "examples/s"),
    "loader_vs_dataloader": ("service_examples_per_s", "dataloader_examples_per_s", "examples/s"),
    "exposed_input_fraction": ("input_wait_s", "loop_wall_s", "s"),
    "trial_overhead_ratio": ("service_overhead_s", "plain_overhead_s", "s"),
    "multiworker_trial_overhead_ratio": ("multiworker_overhead_s", "plain_overhead_s", "s"),
    "eval_interval_wait_s": ("median_s", "ray_train_median_s", "s"),
    "checkpoint_ratio": ("save_s", "torch_save_s", "s"),
    "async_checkpoint_stall_ratio": ("stall_s", "sync_save_s", "s"),
    "async_stall_vs_copy": ("stall_s", "copy_s", "s"),
    "loader_peak_rss_ratio": ("big_rss_growth_mb", "base_rss_growth_mb", "MB"),
}


def _num(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def markdown(results: dict) -> str:
    figures = results["figures"]
    lines = [
        "| figure | value | goal | met | service / baseline (raw) | measured | what |",
        "|---|---|---|---|---|---|---|",
    ]
    for key in GOALS:
        if key not in figures:
            op, goal, what = GOALS[key]
            goal_text = "informational" if op == "info" else f"{op} {goal:g}"
            lines.append(f"| `{key}` | — | {goal_text} | not run | | | {what} |")
            continue
        f = figures[key]
        raw = ""
        if key in BASELINES:
            a, b, unit = BASELINES[key]
            unit = f["raw"].get("baseline_unit", unit)  # what the value counts (a CPU ratio: per CPU second)
            raw = f"{_num(f['raw'][a])} / {_num(f['raw'][b])} {unit}"
        met = "—" if f["goal"] == "informational" else "yes" if f["pass"] else "**no**"
        when = f["raw"].get("measured_at", "?")[:10]
        lines.append(f"| `{key}` | {_num(f['value'])} | {f['goal']} | {met} | {raw} | {when} | {f['what']} |")
    if "scale" in figures:
        lines += ["", *scale_lines(figures["scale"]["raw"])]
    if "cluster" in figures:
        lines += ["", *cluster_lines(figures["cluster"]["raw"])]
    if "coordinator_memory" in figures:
        lines += ["", *memory_lines(figures["coordinator_memory"]["raw"])]
    m = results.get("machine", {})
    lines.append("")
    lines.append(
        f"Measured {m.get('when', '?')} on {m.get('cpus', '?')} CPUs (load average "
        f"{_num(m.get('load_avg_1m', '?'))}), medians over repeats; `make bench` regenerates it."
    )
    return "\n".join(lines) + "\n"


def scale_lines(raw: dict) -> list[str]:
    """The growth curves of `bench/scale.py`: cost at the largest size, log-log slope there."""
    book, mem = raw["bookkeeping"], raw["memory"]
    shard = raw["sharding"]["by_files"]["1024_hosts"]
    curves = [
        ("planning: quasi-random round", raw["planning_trials"], "trials", "s"),
        ("planning: one rank's shard, 1,024 hosts", shard, "files", "s"),
        *[(f"bookkeeping: {k.replace('_', ' ')}", v, "trials", "s") for k, v in book.items()],
        ("memory held", mem["by_trials"], "trials", "bytes"),
        ("memory held vs reports per trial", mem["by_reports_per_trial"], "reports", "bytes"),
    ]
    lines = [
        "Growth (`scale`, log-log slope between the two largest sizes: ~0 O(1), ~1 O(n)):",
        "",
        "| curve | largest size | cost there | per item | slope there | growth |",
        "|---|---|---|---|---|---|",
    ]
    for name, c, what, unit in curves:
        lines.append(
            f"| {name} | {c['sizes'][-1]:,} {what} | {_num(c[unit][-1])} {unit} | "
            f"{_num(c[f'{unit}_per_item_at_top'])} {unit} | {c['top_slope']} | {c['growth']} |"
        )
    return lines


def main() -> None:
    with open(os.path.join(HERE, "results.json")) as f:
        text = markdown(json.load(f))
    with open(DOC) as f:
        doc = f.read()
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(DOC, "w") as f:
        f.write(f"{head}{BEGIN}\n{text}{END}{tail}")


def cluster_lines(raw: dict) -> list[str]:
    """The real study and the multi-host trial of `bench/cluster.py`, in two sentences."""
    s, m = raw["study"], raw["multihost"]
    return [
        f"Cluster (`cluster`): {s['trials']} one-worker trials of {s['steps_per_trial']} steps, "
        f"{s['concurrency']} at once: {_num(s['wall_s'])} s, {_num(s['trials_per_s'])} trials/s, "
        f"{_num(s['fixed_cost_per_trial_s'])} s fixed cost per trial (step loop "
        f"{_num(s['step_loop_s_per_trial'])} s), coordinator + TuneRun processes "
        f"{_num(s['coordinator_cpu_per_trial_ms'])} ms CPU per trial, coordinator resident "
        f"{_num(s['coordinator_rss_at_end_mb'])} MB at the end. {m['hosts']} hosts x "
        f"{m['workers_per_host']} worker: {_num(1e3 * m['step_s'])} ms per step; metric all-reduce "
        f"{_num(1e3 * m['reduce_s_per_eval'])} ms and BN sync {_num(1e3 * m['bn_sync_s_per_eval'])} ms "
        f"per eval ({_num(100 * m['guarantees_share_of_step'])}% of step time at eval every "
        f"{m['eval_every_steps']} steps).",
    ]


def memory_lines(raw: dict) -> list[str]:
    """The coordinator's resident memory along a long study (`bench/coordinator_memory.py`)."""
    floors = raw["floor_rss_anon_mb_by_trials_done"]
    at = ", ".join(f"{d:,}: {mb}" for d, mb in floors[3::4])
    return [
        f"Coordinator memory (`coordinator_memory`): resident anonymous MB between table rewrites "
        f"by trials done ({at}; peak {raw['peak_rss_anon_mb']}); "
        f"growth {_num(raw['growth_per_trial_first_half_kb'])} KB per trial in the first half, "
        f"{_num(raw['growth_per_trial_second_half_kb'])} KB in the second, where its rows grew "
        f"{_num(raw['rows_growth_per_trial_kb'])} KB per trial ({_num(raw['rows_mb_at_end'])} MB "
        f"of rows at the end).",
    ]


if __name__ == "__main__":
    main()
