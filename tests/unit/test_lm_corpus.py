"""The byte-level corpus of `playbook data text` (service/data/text.py): split by file, every byte
of every chosen file the real target of exactly one sequence position, padding never real."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict

import pyarrow.parquet as pq
import pytest

from service.core.errors import DataError
from service.data import text

SEQ_LEN, MAX_BYTES = 48, 120_000


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    text.write_text(str(root), MAX_BYTES, SEQ_LEN)
    return {s: pq.read_table(str(root / s)).to_pylist() for s in ("train", "validation")}


def files_of(rows: list[dict]) -> dict[str, list[dict]]:
    by_file = defaultdict(list)
    for r in rows:
        by_file[r["file"]].append(r)
    return by_file


def test_concatenated_real_tokens_are_the_files_bytes(corpus):
    stdlib = text.stdlib_root()
    ids = [r["example_id"] for split in ("train", "validation") for r in corpus[split]]
    assert ids == list(range(len(ids)))  # unique in the corpus, not only in a split
    for rows in corpus.values():
        for name, seqs in files_of(rows).items():
            with open(os.path.join(stdlib, name), "rb") as f:
                expected = f.read()
            assert [s["chunk"] for s in seqs] == list(range(len(seqs)))
            got = b"".join(s["bytes"][: s["num_tokens"]] for s in seqs)
            assert got == expected, name
            # Every sequence but the file's last is full; padding is zeros, never real.
            assert [s["num_tokens"] for s in seqs[:-1]] == [SEQ_LEN] * (len(seqs) - 1)
            assert 0 < seqs[-1]["num_tokens"] <= SEQ_LEN
            assert seqs[-1]["bytes"][seqs[-1]["num_tokens"] :] == bytes(SEQ_LEN - seqs[-1]["num_tokens"])
            # The token before each sequence: BOS, then the last byte of the one before.
            assert [s["context"] for s in seqs] == [text.BOS] + [
                expected[i * SEQ_LEN - 1] for i in range(1, len(seqs))
            ]


def test_split_is_by_file_and_the_budget_holds(corpus):
    train, validation = (set(files_of(corpus[s])) for s in ("train", "validation"))
    assert train and validation and not train & validation
    stdlib = text.stdlib_root()
    sizes = {s: sum(os.path.getsize(os.path.join(stdlib, f)) for f in files_of(corpus[s])) for s in corpus}
    assert sizes["train"] <= 0.9 * MAX_BYTES and sizes["validation"] <= 0.1 * MAX_BYTES
    assert not any("site-packages" in f for f in train | validation)


def test_a_files_split_does_not_depend_on_the_rest_of_the_corpus(corpus, tmp_path):
    """A corpus of another budget (other files chosen) puts every file they share in the same
    split."""
    text.write_text(str(tmp_path), 3 * MAX_BYTES, SEQ_LEN)
    other = {
        s: {r["file"] for r in pq.read_table(str(tmp_path / s), columns=["file"]).to_pylist()} for s in corpus
    }
    mine = {s: set(files_of(corpus[s])) for s in corpus}
    assert mine["train"] & other["train"] and mine["validation"] & other["validation"]
    assert not mine["train"] & other["validation"] and not mine["validation"] & other["train"]


@pytest.mark.parametrize(
    "data, seq_len, num_tokens, context",
    [
        (b"", 2, [], []),
        (b"abc", 4, [3], [256]),
        (b"abcd", 2, [2, 2], [256, ord("b")]),
        (b"abcde", 2, [2, 2, 1], [256, ord("b"), ord("d")]),
    ],
)
def test_sequences_of_one_file_by_hand(data, seq_len, num_tokens, context):
    targets, ctx, n = text.sequences(data, seq_len)
    assert n.tolist() == num_tokens and ctx.tolist() == context and targets.shape == (len(n), seq_len)
    assert b"".join(t.tobytes()[:k] for t, k in zip(targets, n, strict=True)) == data


def test_a_budget_too_small_for_a_split_is_refused_and_nothing_is_written(tmp_path):
    with pytest.raises(DataError, match=r"^--max-bytes 100: too small, the train split"):
        text.write_text(str(tmp_path / "out"), 100, SEQ_LEN)
    assert not os.path.exists(tmp_path / "out")


def test_the_command_writes_the_corpus(tmp_path):
    out = tmp_path / "data"
    cmd = [
        sys.executable,
        "-m",
        "service",
        "data",
        "text",
        str(out),
        "--max-bytes",
        "60000",
        "--seq-len",
        "32",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for split, files in text.FILES_PER_SPLIT.items():
        table = pq.read_table(str(out / split))
        assert len(os.listdir(out / split)) == files and table.schema.field("bytes").type.byte_width == 32
    bad = subprocess.run([*cmd[:-1], "0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].endswith(
        "--seq-len: must be a positive number of bytes, got 0"
    )
