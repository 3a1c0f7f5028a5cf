"""`playbook report`: a study's self-contained HTML report and its terminal form.

load.py       the study's stored files -> StudyData
sentences.py  verdicts, divergence and eval-sample bias as plain sentences
plots.py      the PNG plots (curves, hyperparameter axes, best-step positions, bias)
isolation_plot.py  the isolation plot: best per scientific value, with its seed repeats
html.py       the page
"""

from __future__ import annotations

from service.core import storage
from service.core.ranking import best_result
from service.report import html, plots
from service.report.load import StudyData, load, study_uri_of
from service.report.sentences import Sentence, all_sentences

__all__ = ["StudyData", "Sentence", "build", "load", "study_uri_of", "write"]


def build(data: StudyData) -> tuple[str, list[Sentence]]:
    """(HTML page, sentences) of a loaded study."""
    sentences = all_sentences(data)
    best = best_result(data.rows, data.mode)
    return html.page(data, best, plots.all_plots(data), sentences), sentences


def write(data: StudyData, out_uri: str | None = None) -> tuple[str, list[Sentence]]:
    """Write the report (default `<study>/report.html`); returns (its URI, the sentences)."""
    page, sentences = build(data)
    out_uri = out_uri or data.layout.report
    storage.write_bytes_atomic(storage.absolute(out_uri), page.encode("utf-8"))
    return out_uri, sentences
