"""`playbook validate --data` builds the workload's model with the study's own values: the lm
study (`studies/lm.yaml`, context 128) over the corpus `playbook data text` writes by default
(sequences of 256 bytes) is refused in one line before anything starts, as is a searched context
whose lower end is too short, or one a round's own search fixes; a context that covers the
sequences passes."""

from __future__ import annotations

import pathlib

import pytest
import yaml

from service import cli

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """`playbook data text DIR` at its default --seq-len (256), on a small byte budget."""
    root = tmp_path_factory.mktemp("text") / "data"
    assert cli.main(["data", "text", str(root), "--max-bytes", "60000"]) == 0
    return root


def validate(tmp_path, capsys, corpus, rounds=None, **search) -> tuple[int, str]:
    study = yaml.safe_load((ROOT / "studies/lm.yaml").read_text())
    study["rounds"] = rounds or study["rounds"]
    study["data"] = {"train": str(corpus / "train"), "validation": str(corpus / "validation")}
    study["storage"] = str(tmp_path / "studies")
    study["search"].update(search)
    path = tmp_path / "lm.yaml"
    path.write_text(yaml.safe_dump(study))
    capsys.readouterr()
    code = cli.main(["validate", "--data", str(path)])
    return code, capsys.readouterr().err


def test_the_lm_study_over_the_default_corpus_is_refused(tmp_path, capsys, corpus):
    code, err = validate(tmp_path, capsys, corpus)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("playbook: error: search: workload lm's model with ")
    assert "context=128" in err and "context 128 is shorter than the data's sequences (256 tokens)" in err
    assert str(corpus / "train") in err  # the file whose first rows it failed on


def test_a_searched_context_is_checked_at_its_short_end(tmp_path, capsys, corpus):
    code, err = validate(
        tmp_path, capsys, corpus, context={"role": "nuisance", "type": "int", "min": 64, "max": 512}
    )
    assert code == 2 and "context=64" in err and "context 64 is shorter" in err, err


def test_a_context_that_covers_the_sequences_passes(tmp_path, capsys, corpus):
    code, err = validate(
        tmp_path, capsys, corpus, context={"role": "nuisance", "type": "choice", "values": [256, 512]}
    )
    assert code == 0, err


def test_a_rounds_own_value_is_checked_too(tmp_path, capsys, corpus):
    """The study's context covers the sequences; a later round's own search fixes a shorter one."""
    rounds = [
        {"name": "explore", "num_trials": 2},
        {"name": "short", "num_trials": 2, "search": {"context": {"role": "fixed", "value": 128}}},
    ]
    code, err = validate(tmp_path, capsys, corpus, rounds, context={"role": "fixed", "value": 256})
    assert code == 2 and "context=128" in err and "context 128 is shorter" in err, err
    code, err = validate(tmp_path, capsys, corpus, rounds[:1], context={"role": "fixed", "value": 256})
    assert code == 0, err
