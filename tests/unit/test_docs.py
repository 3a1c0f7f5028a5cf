"""The README and docs/ as the project promises them: a short README whose links all resolve, the
performance figures shown in one generated place (docs/performance.md, written by
`python -m bench.table` from bench/results.json), and prose that names a figure without copying
its value (a copied value goes stale at the next `make bench`)."""

from __future__ import annotations

import json
import pathlib
import re

from bench.table import BEGIN, END, markdown

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)")


def prose(text: str) -> str:
    """The text without the generated performance block."""
    if BEGIN not in text:
        return text
    head, rest = text.split(BEGIN, 1)
    return head + rest.split(END, 1)[1]


def results() -> dict:
    return json.loads((ROOT / "bench" / "results.json").read_text())


def anchors(path: pathlib.Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    headings = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_readme_is_short_and_every_link_resolves():
    assert len((ROOT / "README.md").read_bytes()) <= 10 * 1024
    broken = []
    for doc in DOCS:
        for target, anchor in LINK.findall(doc.read_text()):
            if "://" in target:
                continue
            path = doc.parent / target if target else doc
            if not path.exists() or (anchor and path.suffix == ".md" and anchor not in anchors(path)):
                broken.append(f"{doc.relative_to(ROOT)}: {target}#{anchor}")
    assert not broken, broken


def test_the_performance_table_is_what_bench_table_writes():
    """docs/performance.md's generated block is `bench.table.markdown` of the stored results."""
    text = (ROOT / "docs" / "performance.md").read_text()
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert block == "\n" + markdown(results())


def test_prose_names_figures_without_restating_them():
    figures = results()["figures"]
    values = {k: f"{f['value']:.3g}" for k, f in figures.items() if isinstance(f["value"], float)}
    values = {k: v for k, v in values.items() if len(re.sub(r"\D", "", v.lstrip("0."))) >= 2}
    found = []
    for doc in DOCS:
        text = prose(doc.read_text())
        # A figure's value in a paragraph that names the figure (elsewhere a number that happens
        # to share its digits, e.g. a timing in another table, is not a restatement).
        for paragraph in text.split("\n\n"):
            for key, value in values.items():
                named = key in paragraph
                if named and re.search(rf"(?<![\d.]){re.escape(value)}(?!\d)", paragraph):
                    found.append(f"{doc.relative_to(ROOT)}: {key}'s value {value}")
        # A figure's name followed by a number: "`step_ratio` (0.94", "`loader_peak_rss_ratio` 1.0".
        for key in figures:
            for m in re.finditer(rf"`{key}`\**\s*\(?~?\d", text):
                found.append(f"{doc.relative_to(ROOT)}: {m.group(0)!r}")
    assert not found, found


def test_the_readme_study_is_valid(tmp_path, capsys):
    """The README's minimal study passes `playbook validate` as it stands."""
    from service import cli

    readme = (ROOT / "README.md").read_text()
    text = readme.split("## A minimal study", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "study.yaml").write_text(text)
    assert cli.main(["validate", str(tmp_path / "study.yaml")]) == 0
    assert capsys.readouterr().out.startswith("ok: study my-study: 2 round(s), 10 trials")
