"""The report page: one self-contained HTML file (inline CSS, plots as PNG data URIs, no
scripts, nothing fetched), so it can be mailed, attached or opened from any storage."""

from __future__ import annotations

import html
import time

from service.core.formatting import cell
from service.core.trial_status import TrialStatus
from service.report.load import StudyData
from service.report.sentences import Sentence

STYLE = """
body { font-family: sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: left; }
th { background: #f0f0f0; }
tr.best td { background: #fde0e0; }
li.warning { color: #a00000; }
img { max-width: 100%; display: block; margin: 0.5em 0 1.5em; }
code { background: #f4f4f4; padding: 1px 3px; }
"""


def _e(v) -> str:
    return html.escape(str(v), quote=True)


def _link(uri: str | None) -> str:
    if not uri:
        return "-"
    href = uri if "://" in uri else "file://" + uri
    return f'<a href="{_e(href)}">{_e(uri)}</a>'


def trial_columns(rows: list[dict]) -> list[str]:
    hps = sorted({k for r in rows for k in r if k.startswith("hp/")})
    return [
        "trial_name", "round", "status", "step", "max_train_steps", "seed", *hps,
        "best_metric", "best_step", "step_verdict", "diverged_at_step", "best_checkpoint",
    ]  # fmt: skip


def trial_table(data: StudyData, best: str | None) -> str:
    cols = trial_columns(data.rows)
    head = "".join(f"<th>{_e(c.removeprefix('hp/'))}</th>" for c in cols).replace(
        "<th>best_metric</th>", f"<th>best {_e(data.metric)}</th>"
    )
    body = []
    for r in data.rows:
        tds = "".join(f"<td>{_e(cell(r.get(c)))}</td>" for c in cols)
        body.append(f"<tr{' class=best' if r['trial_name'] == best else ''}>{tds}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def header(data: StudyData, best_row: dict | None) -> str:
    p, study = data.provenance, data.study
    reproduce = " ".join(p.get("reproduce") or []) or "-"
    items = [
        ("description", _e(study.description or "-")),
        ("study file", _link(data.layout.study_file)),
        ("git commit", _e(p.get("git_commit") or "-") + (" (dirty)" if p.get("git_dirty") else "")),
        ("uncommitted diff", _link(p.get("uncommitted_diff"))),
        ("reproduce", f"<code>{_e(reproduce)}</code>"),
        ("trials", _e(_counts(data.rows))),
    ]
    if best_row:
        items += [
            (f"best {data.metric}", _e(f"{cell(best_row['best_metric'])} ({best_row['trial_name']}, "
                                       f"step {best_row.get('best_step')})")),
            ("best checkpoint", _link(best_row.get("best_checkpoint"))),
        ]  # fmt: skip
    return "<table>" + "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in items) + "</table>"


def _counts(rows: list[dict]) -> str:
    statuses = [r.get("status") for r in rows]
    parts = [
        f"{statuses.count(s)} {s.lower()}"
        for s in (
            TrialStatus.FINISHED,
            TrialStatus.DIVERGED,
            TrialStatus.FAILED,
            TrialStatus.RUNNING,
            TrialStatus.PENDING,
        )
    ]
    return f"{len(rows)}: " + ", ".join(p for p in parts if not p.startswith("0 "))


def sentences_html(sentences: list[Sentence]) -> str:
    out, section = [], None
    for s in sentences:
        if s.section != section:
            if section is not None:
                out.append("</ul>")
            out.append(f"<h3>{_e(s.section)}</h3><ul>")
            section = s.section
        out.append(f'<li class="{_e(s.severity)}"><b>{_e(s.kind)}</b>: {_e(s.text)}</li>')
    if section is not None:
        out.append("</ul>")
    return "".join(out)


def page(
    data: StudyData, best_row: dict | None, plots: list[tuple[str, str]], sentences: list[Sentence]
) -> str:
    best = best_row["trial_name"] if best_row else None
    images = "".join(f'<h3>{_e(t)}</h3><img alt="{_e(t)}" src="{uri}">' for t, uri in plots)
    return (
        '<!DOCTYPE html><html><head><meta charset="utf-8">'
        f"<title>study {_e(data.study.name)}</title><style>{STYLE}</style></head><body>"
        f"<h1>study {_e(data.study.name)}</h1>{header(data, best_row)}"
        f"<h2>playbook verdicts</h2>{sentences_html(sentences)}"
        f"<h2>plots</h2>{images}"
        f"<h2>trials</h2>{trial_table(data, best)}"
        f"<p><small>generated {_e(time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime()))} "
        f"from {_e(data.study_uri)}</small></p></body></html>"
    )
