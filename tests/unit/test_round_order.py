"""`playbook status` and the report list trials round by round, in the order the rounds ran (as
the trial table stores them), each round's by name: not by name alone, which put a round named
`bayes` before the `explore` round it follows."""

from service.cli.results import print_table
from service.tracking.trial_table import in_round_order

ROWS = [  # as the table stores them: rounds in the order they ran, a round's trials as they came
    {"trial_name": "explore-0001", "round": "explore", "status": "FINISHED", "best_metric": 0.3},
    {"trial_name": "explore-0000", "round": "explore", "status": "FINISHED", "best_metric": 0.2},
    {"trial_name": "bayes-0000", "round": "bayes", "status": "FINISHED", "best_metric": 0.1},
    {"trial_name": "ext-0000", "round": "ext", "status": "RUNNING"},
    {"trial_name": "bayes-0001", "round": "bayes", "status": "FINISHED", "best_metric": 0.4},
]
ORDER = ["explore-0000", "explore-0001", "bayes-0000", "bayes-0001", "ext-0000"]


def test_rows_are_listed_round_by_round_in_the_order_the_rounds_ran():
    assert [r["trial_name"] for r in in_round_order(ROWS)] == ORDER


def test_playbook_status_prints_them_in_that_order(capsys):
    print_table(ROWS, "validation/error", "min")
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:6]] == ORDER
    assert lines[6].startswith("best trial: bayes-0000 ")
