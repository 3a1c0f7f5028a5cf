"""`playbook next`'s rules (service/analysis/next_round.py): each verdict -> proposal rule on a
hand-made trial table whose verdicts the real checks compute, with the answer worked out by
hand; the proposal's YAML read back by the study loader; the text insertion that keeps every
other byte of a study file; the rounds shown as a chain."""

from __future__ import annotations

import copy

import pytest

from service.analysis import curve_summary
from service.analysis.input_bound import InputTotals, input_bound
from service.analysis.next_round import as_yaml, propose
from service.analysis.round_checks import verdicts_for_round
from service.analysis.widening import beyond, widen
from service.core.errors import SpecError
from service.study import spec
from service.study.chain import chain
from service.study.rounds_text import append_round
from service.study.search import HParam
from service.study.sections import Curves
from service.study.strict import load_yaml
from tests.helpers.next_round import STUDY, row, stored_study


def study_of(**changes) -> spec.Study:
    d = copy.deepcopy(STUDY)
    d.update(changes)
    return spec.load_dict(d)


def eight(**best) -> list[dict]:
    """Eight finished trials with metrics 0.10 .. 0.17 (the best first) in the middle of the
    space, the best one's values replaced by `best`."""
    rows = [row(i, 0.10 + 0.01 * i, lr=0.05 + 0.01 * i, momentum=0.6 + 0.02 * i) for i in range(8)]
    rows[0] = row(0, 0.10, **best)
    return rows


def of_kind(verdicts, *kinds):
    return [v for v in verdicts if v.kind in kinds]


def fields(p) -> dict:
    return {f.key: f.value for f in p.fields}


# ----------------------------------------------------------------------------- boundary


def test_a_log_range_at_its_upper_bound_widens_tenfold_above():
    study = study_of()
    rows = eight(lr=0.49)  # log10 position of 0.49 in [0.01, 0.5]: 99.5%
    found = of_kind(verdicts_for_round(study, "explore", rows), "boundary")
    p = propose(study, "explore", rows, found)
    assert fields(p)["kind"] == "quasi_random" and fields(p)["name"] == "explore-2"
    assert fields(p)["num_trials"] == 8 and fields(p)["seed"] == 1
    (lr,) = p.search
    assert lr.key == "learning_rate" and (lr.value.min, lr.value.max, lr.value.scale) == (0.01, 5.0, "log")
    assert "boundary" in lr.why and "0.5 -> 5" in lr.why


def test_a_log_range_at_its_lower_bound_widens_tenfold_below():
    study = study_of()
    rows = eight(lr=0.0101)
    p = propose(study, "explore", rows, of_kind(verdicts_for_round(study, "explore", rows), "boundary"))
    (lr,) = p.search
    assert (lr.value.min, lr.value.max) == (0.001, 0.5)


def test_a_linear_range_widens_by_its_width_and_a_fraction_stays_below_1():
    """momentum [0.5, 0.95]: width 0.45; below: 0.5 - 0.45 = 0.05; above: 0.95 + 0.45 = 1.4 is
    past 1, so halfway from 0.95 to 1: 0.975."""
    study = study_of()
    for best, expected in ((0.51, (0.05, 0.95)), (0.94, (0.5, 0.975))):
        rows = eight(momentum=best)
        p = propose(study, "explore", rows, of_kind(verdicts_for_round(study, "explore", rows), "boundary"))
        (m,) = p.search
        assert m.key == "momentum" and (m.value.min, m.value.max) == expected


def test_widening_rules_for_ints_non_negative_ranges_and_choices():
    warmup = HParam(role="nuisance", type="int", min=10, max=50)
    assert (widen(warmup, "upper")[0].max, widen(warmup, "lower")[0].min) == (90, 0)  # 50 + 40; 10 - 40 -> 0
    at_zero = HParam(role="nuisance", type="float", min=0.0, max=0.3)
    assert widen(at_zero, "lower") == (at_zero, "cannot widen past 0")
    assert beyond([8, 16, 32], "upper") == 64 and beyond([8, 16, 32], "lower") == 4  # one ratio
    assert beyond([0.1, 0.2, 0.3], "upper") == 0.4  # ratios 2 and 1.5: the difference
    choice = HParam(role="nuisance", type="choice", values=(8, 16))
    assert widen(choice, "upper")[0].values == (8, 16, 32)
    assert beyond([0.1, 0.2], "lower") == 0.05 and beyond([0.0, 0.5], "upper") == 0.75  # ratio; halfway to 1
    assert widen(HParam(role="nuisance", type="choice", values=(0, 1)), "upper")[1] == "cannot widen past 1"


# ----------------------------------------------------------------------------- trials


def test_too_few_trials_runs_the_round_again_with_twice_the_trials():
    """3 of 8 trials finished (fewer than 5): a round like it, 16 trials, new points."""
    study = study_of()
    rows = eight()
    for r in rows[3:]:
        r["status"] = "FAILED"
    found = of_kind(verdicts_for_round(study, "explore", rows), "enough_trials")
    assert found[0].is_warning
    p = propose(study, "explore", rows, found)
    assert fields(p) == {
        "name": "explore-2",
        "kind": "quasi_random",
        "num_trials": 16,
        "seed": 1,
        "reason": fields(p)["reason"],
    }
    assert p.search == () and "enough_trials: 3 finished, fewer than 5" in fields(p)["reason"]


# ----------------------------------------------------------------------------- steps


def test_late_best_checkpoints_extend_the_best_twice_as_long():
    study = study_of()
    rows = [row(i, 0.1 + 0.01 * i, best_step=900) for i in range(8)]  # every best step > 750 of 1000
    found = of_kind(
        verdicts_for_round(study, "explore", rows), "best_step_distribution", "best_step_position"
    )
    p = propose(study, "explore", rows, found)
    assert fields(p) == {
        "name": "extend",
        "kind": "extend",
        "from_round": "explore",
        "num_trials": 2,
        "step_multiplier": 2.0,
        "reason": "playbook next after round explore: best checkpoints late: 8 of 8 trials (2 of the best 2) "
        "in the last 25% of training",
    }


def flat_tail_logs(last: int) -> dict[str, list[dict]]:
    """Eight trials of 160 steps, validation/error in examples of 270 every 20 steps: 10 wrong
    from step 100 on (0.037037, the user's flat curve), then `last` wrong at step 160."""
    errors = [135, 54, 27, 14, 10, 10, 10, last]
    return {
        f"explore-{i:04d}": [
            {"step": 20 * (j + 1), "validation/error": (e + i) / 270} for j, e in enumerate(errors)
        ]
        for i in range(8)
    }


def test_a_best_value_held_since_before_the_last_quarter_is_not_extended():
    """The best checkpoints are all at step 160 of 160 (the latest of equal values), but each
    trial reached its best at step 100 (62.5%): not late, so no extend round; the same trials
    improving strictly at step 160 (9 wrong, not 10) are late: extended."""
    study = study_of()
    rows = [row(i, (10 + i) / 270, best_step=160, max_train_steps=160) for i in range(8)]
    found = verdicts_for_round(study, "explore", rows, flat_tail_logs(10))
    (position,) = of_kind(found, "best_step_position")
    assert (position.facts["reached_step"], position.facts["position"]) == (100, "middle")
    spread = of_kind(found, "best_step_distribution")
    assert spread[0].facts["late"] == 0
    assert propose(study, "explore", rows, spread).empty
    rows = [row(i, (9 + i) / 270, best_step=160, max_train_steps=160) for i in range(8)]
    found = verdicts_for_round(study, "explore", rows, flat_tail_logs(9))
    (position,) = of_kind(found, "best_step_position")
    assert position.facts["position"] == "late" and "train longer" in position.message
    p = propose(study, "explore", rows, of_kind(found, "best_step_distribution"))
    assert fields(p)["kind"] == "extend" and fields(p)["step_multiplier"] == 2.0


def test_late_best_checkpoints_in_a_compute_bound_study_extend_as_far_as_the_budget_allows():
    """8 trials x 1000 steps spent of 11000: 3000 left for 2 trials of 1000 x m: m = 1.5."""
    study = study_of(budget={"compute_bound": True, "max_total_steps": 11000, "first_round_share": 0.8})
    rows = [row(i, 0.1 + 0.01 * i, best_step=900) for i in range(8)]
    p = propose(
        study, "explore", rows, of_kind(verdicts_for_round(study, "explore", rows), "best_step_distribution")
    )
    assert fields(p)["step_multiplier"] == 1.5
    spent = study_of(budget={"compute_bound": True, "max_total_steps": 9000, "first_round_share": 0.9})
    p = propose(
        spent, "explore", rows, of_kind(verdicts_for_round(spent, "explore", rows), "best_step_distribution")
    )
    assert p.empty and "1000 steps left" in p.notes[0]


def test_one_late_trial_is_counted_as_one_trial():
    """An extend round of one trial of 2000 steps, late: "1 of 1 trial"; in a compute-bound
    study with 1000 steps left (3000, 2000 spent), no longer round of "1 trial" fits."""
    rounds = [{"name": "explore", "num_trials": 8}, {"name": "long", "kind": "extend", "num_trials": 1}]
    study = study_of(rounds=rounds)
    rows = [row(0, 0.1, best_step=1900, rnd="long", max_train_steps=2000, step=2000)]
    p = propose(study, "long", rows, verdicts_for_round(study, "long", rows))
    (kind,) = [f for f in p.fields if f.key == "kind"]
    assert kind.why == "best checkpoints late: 1 of 1 trial (1 of the best 1) in the last 25% of training"
    budget = {"compute_bound": True, "max_total_steps": 3000, "first_round_share": 0.5}
    tight = study_of(rounds=rounds, budget=budget)
    p = propose(tight, "long", rows, verdicts_for_round(tight, "long", rows))
    assert p.empty and p.notes[-1].endswith("the budget has 1000 steps left: no longer round of 1 trial fits")


def test_an_extend_round_still_late_is_extended_again_with_its_trials():
    study = study_of(
        rounds=[{"name": "explore", "num_trials": 8}, {"name": "long", "kind": "extend", "num_trials": 3}]
    )
    rows = [row(i, 0.1, best_step=1900, rnd="long", max_train_steps=2000) for i in range(3)]
    p = propose(study, "long", rows, verdicts_for_round(study, "long", rows))
    assert {k: fields(p)[k] for k in ("name", "kind", "from_round", "num_trials")} == {
        "name": "long-2",
        "kind": "extend",
        "from_round": "long",
        "num_trials": 3,
    }


# ----------------------------------------------------------------------------- clipping


def clipped_history(fraction: float) -> list[dict]:
    """Ten evaluations every 100 steps, gradient norms 1..10: the 90th percentile (numpy's
    linear interpolation) is 9 + 0.1 * (10 - 9) = 9.1."""
    return [
        {"step": 100 * k, "validation/error": 0.5 / k, "train/loss": 1.0 / k, "train/grad_norm": float(k),
         "train/clipped_fraction": fraction}
        for k in range(1, 11)
    ]  # fmt: skip


def test_most_updates_clipped_sets_grad_clip_norm_to_the_suggestion():
    study = study_of()
    rows = [row(0, 0.1, **{"hp/grad_clip_norm": 1.0})]
    found = curve_summary.round_verdicts(
        rows, {"explore-0000": clipped_history(0.8)}, "validation/error", "min", Curves()
    )
    assert {"clipping", "clip_threshold"} <= {v.kind for v in found}
    p = propose(study, "explore", rows, of_kind(found, "clipping", "clip_threshold"))
    (clip,) = p.search
    assert clip.key == "grad_clip_norm" and clip.value == HParam(role="fixed", value=9.1)
    assert "most updates of explore-0000 clipped" in clip.why
    # half or fewer clipped: the suggestion alone is not acted on
    calm = curve_summary.round_verdicts(
        rows, {"explore-0000": clipped_history(0.5)}, "validation/error", "min", Curves()
    )
    assert propose(study, "explore", rows, of_kind(calm, "clipping", "clip_threshold")).empty


def test_early_instability_without_clipping_adds_grad_clip_norm():
    study = study_of()
    h = clipped_history(0.0)
    h[1]["train/loss"] = 5.0  # step 200 of 1000 (in the first 20%): 5.0 against 1.0 at step 100
    rows = [row(0, 0.1)]
    found = curve_summary.round_verdicts(rows, {"explore-0000": h}, "validation/error", "min", Curves())
    p = propose(study, "explore", rows, of_kind(found, "early_instability", "clip_threshold"))
    (clip,) = p.search
    assert clip.value.value == 9.1 and clip.why.startswith("early_instability in explore-0000")


# ----------------------------------------------------------------------------- scientific winner


def repeat_study() -> spec.Study:
    search = {**STUDY["search"], "width": {"role": "scientific", "type": "choice", "values": [8, 16]}}
    rounds = [{"name": "explore", "num_trials": 8}, {"name": "repeats", "kind": "repeat", "num_trials": 3}]
    return study_of(search=search, rounds=rounds)


def repeats(a: list[float], b: list[float]) -> list[dict]:
    rows = [{**row(i, m, rnd="repeats"), "hp/width": 16} for i, m in enumerate(a)]
    return rows + [{**row(3 + i, m, rnd="repeats"), "hp/width": 8} for i, m in enumerate(b)]


def test_a_scientific_winner_beyond_seed_noise_is_fixed_and_the_nuisance_explored_again():
    """width 16: 0.10, 0.11, 0.12; width 8: 0.20, 0.21, 0.22: Welch's t = -12.2, p ~ 0.0003."""
    study = repeat_study()
    rows = repeats([0.10, 0.11, 0.12], [0.20, 0.21, 0.22])
    p = propose(study, "repeats", rows, [])
    (width,) = p.search
    assert width.key == "width" and width.value == HParam(role="fixed", value=16)
    assert "beats width=8" in width.why
    assert {k: fields(p)[k] for k in ("name", "kind", "num_trials", "seed")} == {
        "name": "explore-2",
        "kind": "quasi_random",
        "num_trials": 8,
        "seed": 1,
    }


def test_a_difference_within_seed_noise_fixes_nothing():
    study = repeat_study()
    assert propose(study, "repeats", repeats([0.10, 0.15, 0.20], [0.12, 0.17, 0.22]), []).empty


# ----------------------------------------------------------------------------- input, nothing


def test_input_bound_names_the_input_change_as_a_note():
    study = study_of()
    totals = InputTotals(
        wait_s=5.0, step_s=10.0, read_s=1.0, preprocess_s=1.0
    )  # loader faster than the steps
    v = input_bound("explore-0003", totals, 0.2, remote=False, prefetch_batches=2)
    assert v.facts["cause"] == "prefetch_too_shallow"
    p = propose(study, "explore", eight(), [v])
    assert p.empty and p.notes == (
        "input_bound: explore-0003 waits 50% of its steps: set input.prefetch_batches: 4 (now 2)",
    )


def test_nothing_to_act_on_says_so():
    study = study_of()
    rows = eight()
    found = verdicts_for_round(study, "explore", rows)  # eight results inside the space, none late
    assert not any(v.is_warning for v in found)
    p = propose(study, "explore", rows, found)
    assert p.empty and as_yaml(p) == "  # playbook next: nothing to act on in the verdicts of round explore\n"


# ----------------------------------------------------------------------------- YAML and the file


FILE = """\
# my study: every comment stays
name: nx   # the name
workload: digits
data: {train: d/train, validation: d/val}
training: {max_train_steps: 1000, batch_size: 32, eval_every_steps: 100}
search:
  learning_rate: {role: nuisance, type: float, min: 0.01, max: 0.5, scale: log}
  momentum: {role: nuisance, type: float, min: 0.5, max: 0.95}
  width: {role: fixed, value: 16}
rounds:
    - {name: explore, num_trials: 8}   # round 1
    # the end of round 1
# a comment before the next section
curves: {tail_fraction: 0.25}
"""


def test_the_proposal_appends_as_text_and_reads_back_as_one_more_round():
    study = spec.load_text(FILE)
    rows = eight()
    for r in rows[3:]:
        r["status"] = "FAILED"
    p = propose(study, "explore", rows, of_kind(verdicts_for_round(study, "explore", rows), "enough_trials"))
    block = as_yaml(p, indent=4)
    assert all(
        line.lstrip().startswith("#") or "#" in line for line in block.splitlines() if "reason" not in line
    )
    new = append_round(FILE, block, "study.yaml")
    assert new.replace(block, "", 1) == FILE  # every other byte as it was
    assert new.index(block) == FILE.index("# a comment before")  # after the list, before the next key
    loaded = spec.load_text(new)
    assert loaded.rounds[:-1] == study.rounds and loaded.curves == study.curves
    assert load_yaml(new, "s")["rounds"][-1] == p.round_dict()
    assert loaded.rounds[-1].num_trials == 16 and loaded.rounds[-1].reason.startswith("playbook next after")


def test_a_flow_style_rounds_list_is_refused_in_one_line():
    with pytest.raises(SpecError, match=r"^s.yaml: rounds: is not a block list"):
        flow = FILE.replace(
            "rounds:\n    - {name: explore, num_trials: 8}   # round 1\n", "rounds: [{name: x}]\n"
        )
        append_round(flow, "  - name: y\n", "s.yaml")


def test_the_chain_says_what_each_round_changed_and_why():
    study = study_of(
        rounds=[
            {"name": "explore", "num_trials": 8},
            {"name": "explore-2", "num_trials": 16, "seed": 1, "reason": "enough_trials: 3 finished"},
            {"name": "extend-2", "kind": "extend", "num_trials": 2, "step_multiplier": 2, "reason": "late"},
        ]
    )
    lines = [link.line() for link in chain(study)]
    assert lines == [
        "explore: quasi_random, 8 trials x 1000 steps",
        "explore-2: quasi_random, 16 trials x 1000 steps; changed: trials 8 -> 16, seed 0 -> 1; "
        "why: enough_trials: 3 finished",
        "extend-2: extend from explore-2, 2 trials x 2000 steps; changed: kind quasi_random -> extend, "
        "trials 16 -> 2, steps 1000 -> 2000 (x2); why: late",
    ]


def test_next_refuses_a_study_whose_last_round_has_no_verdicts(tmp_path, capsys):
    """The stored study file is there (the study started), its verdicts.json is not."""
    from service import cli
    from service.core import storage
    from service.study.checks import resolve_paths

    d = {**copy.deepcopy(STUDY), "storage": str(tmp_path / "runs")}
    path = tmp_path / "study.yaml"
    path.write_text(spec.dump_yaml(spec.load_dict(d)))
    study = resolve_paths(spec.load_file(path))  # as the coordinator stores it
    storage.write_bytes_atomic(study.layout.study_file, spec.dump_yaml(study).encode())
    assert cli.main(["next", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"playbook: error: {path}: round explore of study 'nx' has no verdicts yet (not finished)"]
    assert path.read_text() == spec.dump_yaml(spec.load_dict(d))


def test_a_round_with_its_own_search_is_judged_and_widened_in_it_and_its_entries_carried():
    """Round explore-2 searched learning_rate over [0.01, 5.0] (its own entry); its best trial
    at momentum 0.94 is at the upper bound of the study's [0.5, 0.95]: the proposal carries
    explore-2's learning_rate and widens momentum to 0.975; a best learning_rate of 4.9 widens
    explore-2's range (not the study's) tenfold, to 50."""
    wide = {"role": "nuisance", "type": "float", "min": 0.01, "max": 5.0, "scale": "log"}
    study = study_of(rounds=[{"name": "explore", "num_trials": 8}, {"name": "explore-2", "num_trials": 8,
                     "seed": 1, "search": {"learning_rate": wide}}])  # fmt: skip
    rows = [
        {**r, "round": "explore-2", "trial_name": "explore-2-" + r["trial_name"][-4:]}
        for r in eight(momentum=0.94)
    ]
    p = propose(study, "explore-2", rows, of_kind(verdicts_for_round(study, "explore-2", rows), "boundary"))
    assert fields(p)["name"] == "explore-3" and fields(p)["seed"] == 2
    assert {f.key: (f.value.min, f.value.max) for f in p.search} == {
        "learning_rate": (0.01, 5.0),
        "momentum": (0.5, 0.975),
    }
    assert p.search[0].why == "as in round explore-2"
    rows[0]["hp/learning_rate"], rows[0]["hp/momentum"] = 4.9, 0.7
    p = propose(study, "explore-2", rows, of_kind(verdicts_for_round(study, "explore-2", rows), "boundary"))
    assert {f.key: (f.value.min, f.value.max) for f in p.search} == {"learning_rate": (0.01, 50.0)}


def test_a_widened_range_appends_as_the_round_own_search_entry():
    study = spec.load_text(FILE)
    rows = eight(lr=0.49)
    p = propose(study, "explore", rows, of_kind(verdicts_for_round(study, "explore", rows), "boundary"))
    loaded = spec.load_text(append_round(FILE, as_yaml(p, indent=4), "study.yaml"))
    (rnd,) = loaded.rounds[1:]
    assert rnd.search == {
        "learning_rate": HParam(role="nuisance", type="float", min=0.01, max=5.0, scale="log")
    }
    assert loaded.round_space(rnd)["momentum"] == study.search["momentum"]  # the rest: the study's


def test_a_proposal_over_the_budget_is_said_when_printed_and_refused_when_appended(tmp_path, capsys):
    """4 trials x 1000 steps planned of a 5000-step budget; the proposal's 8 more trials would
    plan 12000: printed with the refusal as a note (exit 0), not appended (exit 2, one line)."""
    from service import cli

    budget = {"compute_bound": True, "max_total_steps": 5000, "first_round_share": 0.9}
    path = stored_study(tmp_path, budget=budget)
    text = path.read_text()
    assert cli.main(["next", str(path)]) == 0
    out = capsys.readouterr().out
    assert "num_trials: 8" in out and out.endswith(
        "# note: as written, playbook validate refuses it: budget.max_total_steps: the rounds plan 12000 "
        "training steps (trials x max_train_steps, summed; a repeat round's num_trials per scientific "
        "value), more than the budget of 5000\n"
    )
    assert cli.main(["next", str(path), "--append"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"playbook: error: {path}: the proposed round is refused: budget.max_total_steps:")
    assert path.read_text() == text


def test_next_appends_to_a_stored_study_without_ray(tmp_path, capsys):
    from service import cli

    path = stored_study(tmp_path)
    text = path.read_text()
    assert cli.main(["next", str(path), "--append"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"appended round explore-2 to {path}:\n")
    block = out.split("\n", 1)[1]
    assert path.read_text() == text + block  # rounds: ends the file
    assert [r.num_trials for r in spec.load_file(path).rounds] == [4, 8]


def test_an_extend_round_late_and_mostly_clipped_is_extended_with_grad_clip_norm_raised():
    """Round long (an extend round, 3 seeds of 2000 steps) ends late, and most of its best
    trial's updates were clipped: the next extend round fixes grad_clip_norm at the suggested
    9.1 on top of the configuration it reruns."""
    study = study_of(
        rounds=[{"name": "explore", "num_trials": 8}, {"name": "long", "kind": "extend", "num_trials": 3}]
    )
    rows = [row(0, 0.1, best_step=1900, rnd="long", max_train_steps=2000, **{"hp/grad_clip_norm": 1.0})]
    found = verdicts_for_round(study, "long", rows)
    found += curve_summary.round_verdicts(
        rows, {"long-0000": clipped_history(0.8)}, "validation/error", "min", Curves()
    )
    p = propose(study, "long", rows, found)
    assert (fields(p)["kind"], fields(p)["from_round"], fields(p)["step_multiplier"]) == (
        "extend",
        "long",
        2.0,
    )
    (clip,) = p.search
    assert clip.key == "grad_clip_norm" and clip.value == HParam(role="fixed", value=9.1)
    rounds = [*STUDY["rounds"], {"name": "long", "kind": "extend", "num_trials": 3}, p.round_dict()]
    new = spec.load_dict({**copy.deepcopy(STUDY), "rounds": rounds})
    assert new.rounds[-1].search == {
        "grad_clip_norm": HParam(role="fixed", value=9.1)
    }  # an extend round takes it


def test_a_bound_past_which_every_trial_diverged_is_not_widened():
    """The best trial at learning_rate 0.49 of [0.01, 0.5], the one trial above it (0.495)
    diverged: the feasible region ends there, so the range is not widened above (a note says
    why); momentum's lower bound (0.51) is still widened."""
    study = study_of()
    rows = eight(lr=0.49, momentum=0.51)
    rows.append({**row(8, None, lr=0.495), "status": "DIVERGED"})
    found = of_kind(verdicts_for_round(study, "explore", rows), "boundary", "infeasible_region")
    assert {(v.kind, v.subject, v.facts.get("side")) for v in found if v.is_warning} >= {
        ("boundary", "learning_rate", "upper"),
        ("infeasible_region", "learning_rate", "upper"),
    }
    p = propose(study, "explore", rows, found)
    assert [(f.key, f.value.min, f.value.max) for f in p.search] == [("momentum", 0.05, 0.95)]
    assert p.notes == (
        "boundary: learning_rate at its upper bound, not widened: every trial past it diverged "
        "(infeasible_region); stabilise training (warmup, clipping) first",
    )


def test_a_bayesian_round_with_too_few_trials_is_followed_by_one_warm_started_from_it():
    rounds = [{"name": "explore", "num_trials": 8}, {"name": "tpe", "kind": "bayesian", "num_trials": 3}]
    study = study_of(rounds=rounds)
    rows = [row(i, 0.1 + 0.01 * i, rnd="tpe") for i in range(3)]
    p = propose(study, "tpe", rows, of_kind(verdicts_for_round(study, "tpe", rows), "enough_trials"))
    assert {k: v for k, v in fields(p).items() if k != "reason"} == {
        "name": "tpe-2",
        "kind": "bayesian",
        "num_trials": 6,
        "seed": 1,
        "from_round": "tpe",
    }
    spec.load_dict({**copy.deepcopy(STUDY), "rounds": [*rounds, p.round_dict()]})  # a valid round


def test_a_grid_round_at_the_edge_of_a_choice_grows_by_one_value_and_counts_its_combinations():
    """momentum a nuisance choice [0.8, 0.9] x width [8, 16] (scientific): the best trial at
    momentum 0.9, the largest: 0.9 x 0.9 / 0.8 = 1.0125 is past 1, so halfway from 0.9 to 1,
    0.95, is added: 3 x 2 = 6 trials."""
    search = {
        "learning_rate": {"role": "fixed", "value": 0.1},
        "momentum": {"role": "nuisance", "type": "choice", "values": [0.8, 0.9]},
        "width": {"role": "scientific", "type": "choice", "values": [8, 16]},
    }
    study = study_of(search=search, rounds=[{"name": "grid", "kind": "grid", "num_trials": 4}])
    rows = [
        {**row(i, 0.1 + 0.01 * i, momentum=m, rnd="grid"), "hp/width": w}
        for i, (m, w) in enumerate([(0.9, 8), (0.8, 8), (0.9, 16), (0.8, 16)])
    ]
    p = propose(study, "grid", rows, of_kind(verdicts_for_round(study, "grid", rows), "boundary"))
    assert (fields(p)["kind"], fields(p)["num_trials"]) == ("grid", 6)
    assert [(f.key, f.value.values) for f in p.search] == [("momentum", (0.8, 0.9, 0.95))]
    rounds = [{"name": "grid", "kind": "grid", "num_trials": 4}, p.round_dict()]
    spec.load_dict({**copy.deepcopy(STUDY), "search": search, "rounds": rounds})  # a valid grid round
