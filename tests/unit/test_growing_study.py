"""A study that grows round by round (no Ray): a rerun may add rounds after the stored ones
(any other change refused, naming the field), a round's own `search:` entries make its space
(planning, verdicts and the isolation plot use it; `best_of` fixes a value to an earlier
round's best), and `from_round: other-study/round` builds on another study's trials."""

from __future__ import annotations

import copy
import math

import pytest
import yaml

from service import cli
from service.analysis.isolation import isolation
from service.analysis.round_checks import verdicts_for_round
from service.core import storage
from service.core.errors import SpecError, StudyStopped
from service.planning.rounds import as_source_rows, plan_round
from service.study import spec
from service.study.checks import check_workload
from service.study.stored import check_same_study, link_rounds, load_stored
from tests.helpers.studies import study_dict

WIDE = {"role": "nuisance", "type": "float", "min": 0.01, "max": 1.0, "scale": "log"}


def growing(tmp_path, *rounds, **overrides) -> dict:
    """The tests' small study (learning_rate in [0.01, 0.5], log) with these rounds."""
    return study_dict(tmp_path / "data", tmp_path / "runs", name="grow", rounds=list(rounds), **overrides)


def store(study: spec.Study) -> None:
    """What the coordinator stores when a study starts: its study file."""
    storage.write_bytes_atomic(study.layout.study_file, spec.dump_yaml(study).encode())


def row(trial: str, rnd: str, metric: float, **hp) -> dict:
    return {
        "trial_name": trial,
        "round": rnd,
        "status": "FINISHED",
        "best_metric": metric,
        "best_step": 20,
        "max_train_steps": 40,
        "step": 40,
        **{f"hp/{k}": v for k, v in hp.items()},
    }


# ----------------------------------------------------------------------------- appending rounds


def test_a_rerun_may_add_rounds_after_the_stored_ones(tmp_path):
    one = spec.load_dict(growing(tmp_path, {"name": "explore", "num_trials": 2}))
    store(one)
    two = spec.load_dict(
        growing(
            tmp_path,
            {"name": "explore", "num_trials": 2},
            {"name": "longer", "kind": "extend", "num_trials": 1},
        )
    )
    check_same_study(two)  # grows: accepted
    store(two)
    three = copy.deepcopy(growing(tmp_path, *spec.to_dict(two)["rounds"]))
    three["rounds"].append({"name": "wider", "num_trials": 2, "search": {"learning_rate": WIDE}})
    check_same_study(spec.load_dict(three))


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda d: d["rounds"][0].update(num_trials=3), r"rounds\[0\]\.num_trials"),
        (lambda d: d["rounds"][0].update(search={"learning_rate": WIDE}), r"rounds\[0\]\.search"),
        (lambda d: d["search"]["learning_rate"].update(max=0.9), r"search\.learning_rate\.max"),
        (lambda d: d["training"].update(max_train_steps=41), r"training\.max_train_steps"),
        (lambda d: d["rounds"].pop(1), r"rounds\[1\]\.name"),  # one removed, one in its place
        (lambda d: d["rounds"].__delitem__(slice(1, None)), r"rounds;"),  # fewer rounds than stored
    ],
)
def test_an_appended_study_that_edits_a_stored_round_or_what_it_depends_on_is_refused(
    tmp_path, change, field
):
    stored = growing(
        tmp_path, {"name": "explore", "num_trials": 2}, {"name": "longer", "kind": "extend", "num_trials": 1}
    )
    store(spec.load_dict(stored))
    grown = copy.deepcopy(stored)
    grown["rounds"].append({"name": "more", "num_trials": 2})
    change(grown)
    with pytest.raises(SpecError, match=rf"^name: study 'grow' already exists .* different {field}") as e:
        check_same_study(spec.load_dict(grown))
    assert "add rounds after its rounds (explore, longer) to grow it" in str(e.value)
    assert "\n" not in str(e.value)


def test_an_edited_stored_round_is_refused_by_playbook_run_in_one_line(tmp_path, capsys):
    """Before anything is written: the stored study file is left as it was."""
    (tmp_path / "data").mkdir()
    stored = growing(tmp_path, {"name": "explore", "num_trials": 2})
    store(spec.load_dict(stored))
    before = storage.read_bytes(spec.load_dict(stored).layout.study_file)
    stored["rounds"][0]["num_trials"] = 5
    stored["rounds"].append({"name": "more", "num_trials": 2})
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(stored))
    from service.data.builtin import write_digits

    write_digits(str(tmp_path / "data"))
    assert cli.main(["run", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "different rounds[0].num_trials" in err[0], err
    assert storage.read_bytes(spec.load_dict(stored).layout.study_file) == before


# ----------------------------------------------------------------------------- a round's own space


def test_a_round_plans_in_its_own_widened_space(tmp_path):
    study = spec.load_dict(
        growing(
            tmp_path,
            {"name": "explore", "num_trials": 8},
            {"name": "wider", "num_trials": 8, "search": {"learning_rate": WIDE}},
        )
    )
    narrow, wide = (plan_round(study, r, []) for r in study.rounds)
    lrs = [c["hparams"]["learning_rate"] for c in wide]
    assert all(0.01 <= lr <= 0.5 for lr in (c["hparams"]["learning_rate"] for c in narrow))
    assert all(0.01 <= lr <= 1.0 for lr in lrs) and any(lr > 0.5 for lr in lrs)
    # The same scrambled Halton point mapped onto each range, in log space: the first
    # coordinate's fraction of the way is the same in both rounds.
    for a, b in zip(narrow, wide, strict=True):
        f_narrow = math.log(a["hparams"]["learning_rate"] / 0.01) / math.log(50)
        f_wide = math.log(b["hparams"]["learning_rate"] / 0.01) / math.log(100)
        assert f_narrow == pytest.approx(f_wide, rel=1e-9)
        assert b["hparams"]["width"] == 4 and b["hparams"]["momentum"] == a["hparams"]["momentum"]


def test_best_of_fixes_a_value_to_an_earlier_rounds_best(tmp_path):
    study = spec.load_dict(
        growing(
            tmp_path,
            {"name": "explore", "num_trials": 3},
            {
                "name": "lr-only",
                "num_trials": 4,
                "search": {"momentum": {"role": "fixed", "best_of": "explore"}},
            },
        )
    )
    rnd = study.rounds[1]
    with pytest.raises(
        StudyStopped, match="round explore has no finished trial to take momentum's value from"
    ):
        plan_round(study, rnd, [])
    rows = [
        row("explore-0000", "explore", 0.5, learning_rate=0.1, momentum=0.61, width=4),
        row("explore-0001", "explore", 0.2, learning_rate=0.2, momentum=0.83, width=4),  # the best
        row("explore-0002", "explore", 0.3, learning_rate=0.3, momentum=0.7, width=4),
    ]
    configs = plan_round(study, rnd, rows)
    assert [c["hparams"]["momentum"] for c in configs] == [0.83] * 4
    assert len({c["hparams"]["learning_rate"] for c in configs}) == 4  # still searched


def test_an_extend_rounds_own_entries_fix_values_on_the_configuration_it_reruns(tmp_path):
    study = spec.load_dict(
        growing(
            tmp_path,
            {"name": "explore", "num_trials": 2},
            {
                "name": "longer",
                "kind": "extend",
                "num_trials": 1,
                "search": {
                    "momentum": {"role": "fixed", "value": 0.9},
                    "grad_clip_norm": {"role": "fixed", "value": 1.5},
                },
            },
        )
    )
    rows = [row("explore-0000", "explore", 0.4, learning_rate=0.1, momentum=0.6, width=4)]
    (config,) = plan_round(study, study.rounds[1], rows)
    assert config["hparams"] == {"learning_rate": 0.1, "momentum": 0.9, "width": 4, "grad_clip_norm": 1.5}
    assert config["extended_from"] == "explore-0000" and config["max_train_steps"] == 80


def test_each_rounds_verdicts_are_judged_in_its_own_space(tmp_path):
    """The best learning rate, 0.098: in [0.01, 0.1] (log) it sits at log(9.8)/log(10) = 99% of
    the range (upper boundary warning); in the widened [0.01, 1] at log(9.8)/log(100) = 50%."""
    narrow = {"role": "nuisance", "type": "float", "min": 0.01, "max": 0.1, "scale": "log"}
    study = spec.load_dict(
        growing(
            tmp_path,
            {"name": "explore", "num_trials": 3},
            {"name": "wider", "num_trials": 3, "search": {"learning_rate": WIDE}},
            search={"learning_rate": narrow, "width": {"role": "fixed", "value": 4}},
            training={"optimizer": "adamw"},
        )
    )
    rows = []
    for rnd in ("explore", "wider"):
        rows += [
            row(f"{rnd}-0000", rnd, 0.10, learning_rate=0.098, width=4),
            row(f"{rnd}-0001", rnd, 0.30, learning_rate=0.02, width=4),
            row(f"{rnd}-0002", rnd, 0.20, learning_rate=0.05, width=4),
        ]

    def lr_boundary(rnd):
        (v,) = [v for v in verdicts_for_round(study, rnd, rows) if v.kind == "boundary"]
        return v

    first, second = lr_boundary("explore"), lr_boundary("wider")
    assert first.is_warning and "[0.01, 0.1]" in first.message and "upper bound 0.1" in first.message
    assert dict(first.data)["position"] == pytest.approx(math.log(9.8) / math.log(10))
    assert not second.is_warning and "[0.01, 1]" in second.message
    assert dict(second.data)["positions"] == pytest.approx((math.log(9.8) / math.log(100),))


def test_the_isolation_plot_has_a_scientific_hyperparameter_a_round_adds(tmp_path):
    study = spec.load_dict(
        growing(
            tmp_path,
            {"name": "explore", "num_trials": 2},
            {
                "name": "by-width",
                "num_trials": 4,
                "search": {"width": {"role": "scientific", "type": "choice", "values": [4, 8]}},
            },
        )
    )
    rows = [
        row("explore-0000", "explore", 0.5, learning_rate=0.1, momentum=0.6, width=4),
        row("explore-0001", "explore", 0.4, learning_rate=0.2, momentum=0.6, width=4),
        row("by-width-0000", "by-width", 0.3, learning_rate=0.1, momentum=0.6, width=4),
        row("by-width-0001", "by-width", 0.2, learning_rate=0.2, momentum=0.6, width=8),
        row("by-width-0002", "by-width", 0.25, learning_rate=0.3, momentum=0.6, width=8),
    ]
    (series,) = isolation(study, rows)["width"]  # round explore had width fixed: no series
    assert series.round == "by-width"
    assert [(p.value, p.best_metric, p.trial_name) for p in series.points] == [
        (4, 0.3, "by-width-0000"),
        (8, 0.2, "by-width-0001"),
    ]


@pytest.mark.parametrize(
    "rounds, message",
    [
        (
            [
                {"name": "e", "num_trials": 2},
                {"name": "x", "kind": "extend", "num_trials": 1, "search": {"learning_rate": WIDE}},
            ],
            r"^rounds\[1\]\.search\.learning_rate: kind extend reruns configurations: its own entries "
            r"may only be role fixed$",
        ),
        (
            [
                {"name": "e", "num_trials": 2, "search": {"momentum": {"role": "fixed", "best_of": "f"}}},
                {"name": "f", "num_trials": 2},
            ],
            r"^rounds\[0\]\.search\.momentum\.best_of: no earlier round named 'f'$",
        ),
        (
            [
                {"name": "e", "num_trials": 2},
                {"name": "f", "num_trials": 2, "search": {"beta1": {"role": "fixed", "best_of": "e"}}},
            ],
            r"^rounds\[1\]\.search\.beta1\.best_of: round e has no hyperparameter beta1$",
        ),
        (
            [
                {"name": "e", "num_trials": 2},
                {"name": "f", "num_trials": 2, "search": {"beta1": {"role": "fixed", "value": 0.8}}},
            ],
            r"^rounds\[1\]\.search\.beta1: not read by optimizer nesterov \(only by adamw\)$",
        ),
        (
            [
                {"name": "e", "num_trials": 2},
                {"name": "f", "num_trials": 2, "search": {"momentum": {"role": "nuisance", "best_of": "e"}}},
            ],
            r"^rounds\[1\]\.search\.momentum\.best_of: only for role fixed \(role is nuisance\)$",
        ),
        (
            [
                {"name": "e", "num_trials": 2},
                {"name": "x", "kind": "extend", "from_round": "grow/e", "num_trials": 1},
            ],
            r"^rounds\[1\]\.from_round: names this study: give the round alone \('e'\)$",
        ),
    ],
)
def test_bad_round_search_entries_are_refused_naming_the_field(tmp_path, rounds, message):
    with pytest.raises(SpecError, match=message):
        spec.load_dict(growing(tmp_path, *rounds))


def test_study_level_best_of_is_refused(tmp_path):
    d = growing(tmp_path, {"name": "e", "num_trials": 2})
    d["search"]["momentum"] = {"role": "fixed", "best_of": "e"}
    with pytest.raises(SpecError, match=r"^search\.momentum\.best_of: only in a round's search"):
        spec.load_dict(d)


def test_an_override_the_workload_does_not_read_is_refused_in_one_line(tmp_path, capsys):
    d = growing(
        tmp_path,
        {"name": "e", "num_trials": 2},
        {"name": "f", "num_trials": 2, "search": {"depth": {"role": "fixed", "value": 3}}},
    )
    with pytest.raises(
        SpecError,
        match=r"^rounds\[1\]\.search\.depth: not a hyperparameter of the optimizer or of workload digits",
    ):
        check_workload(spec.load_dict(d))
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(d))
    assert cli.main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "playbook: error: rounds[1].search.depth: not a hyperparameter"
    )


# ----------------------------------------------------------------------------- another study's round


def test_a_round_links_another_studys_round_and_extends_its_best(tmp_path):
    a = spec.load_dict(dict(growing(tmp_path, {"name": "explore", "num_trials": 2}), name="a"))
    store(a)
    b_raw = dict(
        growing(tmp_path, {"name": "longer", "kind": "extend", "from_round": "a/explore", "num_trials": 2}),
        name="b",
    )
    b = spec.load_dict(b_raw)
    assert b.unlinked(b.rounds[0])
    b = link_rounds(b)
    (linked,) = b.linked
    assert (linked.name, linked.max_train_steps) == ("a/explore", 40)
    assert b.round_steps(b.rounds[0]) == 80  # twice the steps study a's round ran
    assert "linked" not in spec.dump_yaml(b)
    rows_a = [
        row("explore-0000", "explore", 0.5, learning_rate=0.1, momentum=0.6, width=4),
        row("explore-0001", "explore", 0.2, learning_rate=0.3, momentum=0.7, width=4),
    ]
    configs = plan_round(b, b.rounds[0], as_source_rows("a", rows_a))
    assert [c["extended_from"] for c in configs] == ["a/explore-0001"] * 2
    assert [c["hparams"] for c in configs] == [{"learning_rate": 0.3, "momentum": 0.7, "width": 4}] * 2
    assert configs[0]["schedule_origin"].startswith(
        "cosine schedule of a/explore-0001 (40 steps) stretched to 80"
    )


@pytest.mark.parametrize(
    "ref, message",
    [
        ("nobody/explore", r"^rounds\[0\]\.from_round: no study 'nobody' under "),
        ("a/nope", r"^rounds\[0\]\.from_round: study a has no round 'nope' \(its rounds: explore\)$"),
    ],
)
def test_a_round_of_an_unknown_study_or_round_is_refused_in_one_line(tmp_path, capsys, ref, message):
    store(spec.load_dict(dict(growing(tmp_path, {"name": "explore", "num_trials": 2}), name="a")))
    d = dict(
        growing(tmp_path, {"name": "longer", "kind": "extend", "from_round": ref, "num_trials": 1}), name="b"
    )
    with pytest.raises(SpecError, match=message):
        link_rounds(spec.load_dict(d))
    path = tmp_path / "b.yaml"
    path.write_text(yaml.safe_dump(d))
    assert cli.main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "from_round" in err[0], err


def test_repeat_and_bayesian_rounds_build_on_another_studys_round(tmp_path):
    """A repeat round reruns study a's best trial as long as it ran (repeat_of names it); a
    bayesian round's sampler is warm-started with study a's finished trials."""
    from service.planning import bayesian

    store(spec.load_dict(dict(growing(tmp_path, {"name": "explore", "num_trials": 3}), name="a")))
    rounds = [
        {"name": "again", "kind": "repeat", "from_round": "a/explore", "num_trials": 2},
        {"name": "tpe", "kind": "bayesian", "from_round": "a/explore", "num_trials": 2},
    ]
    b = link_rounds(spec.load_dict(dict(growing(tmp_path, *rounds), name="b")))
    rows_a = [
        row("explore-0000", "explore", 0.5, learning_rate=0.1, momentum=0.6, width=4),
        row("explore-0001", "explore", 0.2, learning_rate=0.3, momentum=0.7, width=4),
        {
            **row("explore-0002", "explore", 0.1, learning_rate=0.4, momentum=0.8, width=4),
            "status": "RUNNING",
        },
    ]
    source = as_source_rows("a", rows_a)
    configs = plan_round(b, b.rounds[0], source)
    assert [(c["repeat_of"], c["seed"], c["max_train_steps"]) for c in configs] == [
        ("a/explore-0001", 1, 40),
        ("a/explore-0001", 2, 40),
    ]
    warm = bayesian.optuna_study(b, b.rounds[1], source, None).trials
    assert sorted(t.params["learning_rate"] for t in warm) == [0.1, 0.3]  # the finished ones


def test_studies_that_build_on_each_others_rounds_link_without_end(tmp_path):
    """a's explore, then b extends it, then a grows by a round extending b's: linking either
    follows the rounds back in time only (a/explore: 40 steps, b/longer: 80, a/longest: 160)."""
    a1 = dict(growing(tmp_path, {"name": "explore", "num_trials": 2}), name="a")
    b = dict(
        growing(tmp_path, {"name": "longer", "kind": "extend", "from_round": "a/explore", "num_trials": 1}),
        name="b",
    )
    store(spec.load_dict(a1))
    store(link_rounds(spec.load_dict(b)))
    a2 = dict(
        a1,
        rounds=[
            *a1["rounds"],
            {"name": "longest", "kind": "extend", "from_round": "b/longer", "num_trials": 1},
        ],
    )
    a = link_rounds(spec.load_dict(a2))
    store(a)
    assert a.round_steps(a.rounds[1]) == 160
    linked_b = link_rounds(spec.load_dict(b))
    assert [(r.name, r.max_train_steps) for r in linked_b.linked] == [("a/explore", 40)]
    assert load_stored(a.study_uri).round_steps(a.rounds[1]) == 160
