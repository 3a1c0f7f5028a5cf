"""An extend round reruns one trial's configuration with different seeds: its round sentence
says so ("best of N seed repeats of <trial>"), and the status and report tables show each
trial's seed, so the repeats' rows are told apart."""

from __future__ import annotations

import html as html_lib
import re

from service.analysis.report_lines import round_verdicts
from service.cli.results import print_table
from service.report.html import trial_table
from service.report.load import StudyData
from service.report.sentences import divergence_sentences
from service.study import spec


def study() -> spec.Study:
    return spec.load_dict(
        {
            "name": "seeds",
            "workload": "digits",
            "data": {"train": "a", "validation": "b"},
            "training": {"max_train_steps": 100, "batch_size": 8, "eval_every_steps": 50, "seed": 7},
            "search": {"learning_rate": {"role": "nuisance", "min": 0.01, "max": 1.0, "scale": "log"}},
            "rounds": [
                {"name": "explore", "num_trials": 2},
                {"name": "exploit", "kind": "extend", "num_trials": 3},
            ],
        }
    )


def row(name: str, metric: float | None, seed: int, status: str = "FINISHED", **extra) -> dict:
    rnd = name.split("-")[0]
    return {
        "trial_name": name,
        "round": rnd,
        "status": status,
        "step": 100 if rnd == "explore" else 200,
        "best_metric": metric,
        "best_step": 100,
        "seed": seed,
        "hp/learning_rate": 0.25 if rnd == "exploit" else 0.1 + 0.1 * int(name[-1]),
        **({"extended_from": "explore-0001"} if rnd == "exploit" else {}),
        **extra,
    }


ROWS = [
    row("explore-0000", 0.30, 7),
    row("explore-0001", 0.20, 7),
    row("exploit-0000", 0.15, 7),
    row("exploit-0001", 0.12, 8),
    row("exploit-0002", None, 9, status="DIVERGED", diverged_at_step=40),
]


def test_extend_round_sentence_counts_seed_repeats_of_the_extended_trial():
    sentence = round_verdicts(study(), "exploit", ROWS)["scientific"]
    assert sentence == (
        "The best trial is exploit-0001 (seed 8, validation/error 0.12; best of 2 seed repeats of "
        "explore-0001, seeds 7, 8)"
    )
    assert "nuisance" not in sentence
    # An exploration round is still a best over the nuisance hyperparameters.
    assert (
        "best of 2 trials over the nuisance hyperparameters"
        in round_verdicts(study(), "explore", ROWS)["scientific"]
    )


def test_status_table_has_a_seed_column(capsys):
    print_table(ROWS, "validation/error", "min")
    lines = capsys.readouterr().out.splitlines()
    header = lines[0].split()
    assert header[:4] == ["trial_name", "status", "step", "seed"]
    seeds = {line.split()[0]: line.split()[3] for line in lines[1:6]}
    assert seeds == {
        "explore-0000": "7",
        "explore-0001": "7",
        "exploit-0000": "7",
        "exploit-0001": "8",
        "exploit-0002": "9",
    }


def test_report_trial_table_has_a_seed_column():
    data = StudyData(study=study(), study_uri="/nowhere", rows=ROWS, histories={}, verdicts=[], provenance={})
    page = trial_table(data, best="exploit-0001")
    head = re.findall(r"<th>(.*?)</th>", page.split("</thead>")[0])
    i = head.index("seed")
    cells = [re.findall(r"<td[^>]*>(.*?)</td>", tr) for tr in page.split("</thead>")[1].split("</tr>")[:-1]]
    assert {html_lib.unescape(c[0]): c[i] for c in cells} == {
        "explore-0000": "7",
        "explore-0001": "7",
        "exploit-0000": "7",
        "exploit-0001": "8",
        "exploit-0002": "9",
    }


def test_a_diverged_seed_repeat_is_named_with_its_seed():
    data = StudyData(study=study(), study_uri="/nowhere", rows=ROWS, histories={}, verdicts=[], provenance={})
    (s,) = divergence_sentences(data)
    assert s.text.endswith("at step 40 with learning_rate=0.25, seed=9.")
