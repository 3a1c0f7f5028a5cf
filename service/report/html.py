"""The report page: one self-contained HTML file (inline CSS, plots as PNG data URIs, one small
inline script that sorts the trial table, nothing fetched), so it can be mailed, attached or
opened from any storage. Laid out for a laptop's width: long values wrap inside their cells,
each trial's warnings are short tags whose sentence opens on a click."""

from __future__ import annotations

import html
import time

from service.core.formatting import cell
from service.core.trial_status import TrialStatus
from service.report.load import StudyData
from service.report.sentences import Sentence
from service.report.tags import Tag, trial_tags
from service.study.chain import chain

STYLE = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: left; vertical-align: top;
         overflow-wrap: anywhere; }
table.trials td { white-space: nowrap; overflow-wrap: normal; }
table.trials td.verdicts { white-space: normal; min-width: 14em; }
table.trials th { overflow-wrap: normal; }
th { background: #f0f0f0; }
table.trials { width: 100%; }
table.trials th { cursor: pointer; user-select: none; }
table.trials th[aria-sort=ascending]::after { content: " \\25B2"; }
table.trials th[aria-sort=descending]::after { content: " \\25BC"; }
tr.best td { background: #fde0e0; }
li.warning { color: #a00000; }
.tag { display: inline-block; font-size: 0.9em; border-radius: 3px; padding: 0 4px; margin: 1px 2px 1px 0;
       background: #eef; color: #224; white-space: nowrap; }
.tag.warning { background: #fde0e0; color: #a00000; }
details.tag { position: relative; }
details.tag summary { cursor: pointer; list-style: none; }
details.tag summary::-webkit-details-marker { display: none; }
details.tag p { position: absolute; left: 0; top: 1.4em; z-index: 2; width: min(36em, 60vw); margin: 0;
                padding: 6px 8px; white-space: normal; background: #fff; color: #222;
                border: 1px solid #999; box-shadow: 0 2px 6px rgba(0, 0, 0, 0.2); }
img { max-width: 100%; height: auto; display: block; margin: 0.5em 0 1.5em; }
p.caption { margin: -1em 0 1.5em; max-width: 60em; font-size: 0.9em; }
code { background: #f4f4f4; padding: 1px 3px; overflow-wrap: anywhere; }
"""

SORT_SCRIPT = """
function sortKey(td) {
  const v = td.dataset.v, n = Number(v);
  return v === "" ? null : (isNaN(n) ? v : n);
}
function compareKeys(a, b) {
  if (typeof a === "number" && typeof b === "number") return a - b;
  return String(a).localeCompare(String(b));
}
document.querySelectorAll("table.trials th").forEach((th, i) => th.addEventListener("click", () => {
  const table = th.closest("table"), body = table.tBodies[0];
  const dir = th.getAttribute("aria-sort") === "ascending" ? -1 : 1;
  table.querySelectorAll("th").forEach(h => h.removeAttribute("aria-sort"));
  th.setAttribute("aria-sort", dir > 0 ? "ascending" : "descending");
  const rows = Array.from(body.rows).map((r, k) => [sortKey(r.cells[i]), k, r]);
  rows.sort(([a, ka], [b, kb]) =>
    a === null || b === null ? (a === null) - (b === null) || ka - kb : dir * compareKeys(a, b) || ka - kb);
  rows.forEach(([, , r]) => body.appendChild(r));
}));
"""
"""Click a header: sort by that column, ascending, then descending; numbers as numbers, missing
values last either way, ties in their current order."""


def _e(v) -> str:
    return html.escape(str(v), quote=True)


def _link(uri: str | None, text: str | None = None) -> str:
    if not uri:
        return "-"
    href = uri if "://" in uri else "file://" + uri
    return f'<a href="{_e(href)}" title="{_e(uri)}">{_e(text or uri)}</a>'


def trial_columns(rows: list[dict]) -> list[str]:
    """The trial table's columns: the diverged step shows in `status`, the best checkpoint is
    the link on `best_step`, `step` shows "step/max_train_steps"."""
    hps = sorted({k for r in rows for k in r if k.startswith("hp/")})
    return ["trial_name", "round", "status", "best_metric", "best_step", "verdicts", *hps, "seed", "step"]


HEADERS = {"trial_name": "trial", "best_step": "best step"}


def _header(col: str, metric: str) -> str:
    """A column's header, breakable after '_' and '/' (long hyperparameter names wrap)."""
    text = f"best {metric}" if col == "best_metric" else HEADERS.get(col, col.removeprefix("hp/"))
    return _e(text).replace("_", "_<wbr>").replace("/", "/<wbr>")


def tags_html(tags: list[Tag]) -> str:
    """Each tag a `<details>`: the label shows, a click opens the sentence."""
    return "".join(
        f'<details class="tag {_e(t.severity)}"><summary>{_e(t.label)}</summary><p>{_e(t.text)}</p></details>'
        for t in tags
    )


def _sort_value(v) -> str:
    """What the sort compares: a number as a number, '' for a missing value."""
    if v is None:
        return ""
    return repr(float(v)) if isinstance(v, int | float) and not isinstance(v, bool) else str(v)


def _cell(col: str, row: dict) -> str:
    v = row.get(col)
    if col == "status" and row.get("diverged_at_step") is not None:
        return _e(f"{v} at {cell(row['diverged_at_step'])}")
    if col == "best_step" and row.get("best_checkpoint"):
        return _link(row["best_checkpoint"], cell(v))
    if col == "step":
        return _e(f"{cell(v)}/{cell(row.get('max_train_steps'))}")
    return _e(cell(v))


def _td(col: str, row: dict, tags: list[Tag]) -> str:
    if col == "verdicts":
        return f'<td class="verdicts" data-v="{len(tags)}">{tags_html(tags)}</td>'
    return f'<td data-v="{_e(_sort_value(row.get(col)))}">{_cell(col, row)}</td>'


def trial_table(data: StudyData, best: str | None) -> str:
    cols = trial_columns(data.rows)
    head = "".join(f"<th>{_header(c, data.metric)}</th>" for c in cols)
    body = []
    for r in data.rows:
        tags = trial_tags(data, r)
        tds = "".join(_td(c, r, tags) for c in cols)
        body.append(f"<tr{' class=best' if r['trial_name'] == best else ''}>{tds}</tr>")
    return f'<table class="trials"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


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
            TrialStatus.STOPPED,
            TrialStatus.RUNNING,
            TrialStatus.PENDING,
        )
    ]
    return f"{len(rows)}: " + ", ".join(p for p in parts if not p.startswith("0 "))


def rounds_table(data: StudyData) -> str:
    """The rounds as a chain: each round, what it changed from the one before, and why."""
    head = "<tr><th>round</th><th>kind</th><th>trials x steps</th><th>changed</th><th>why</th></tr>"
    body = "".join(
        f"<tr><td>{_e(k.round)}</td><td>{_e(k.kind + (f' from {k.source}' if k.source else ''))}</td>"
        f"<td>{k.num_trials} x {k.steps}</td><td>{_e(', '.join(k.changes) or '-')}</td>"
        f"<td>{_e(k.reason or '-')}</td></tr>"
        for k in chain(data.study)
    )
    return f'<table class="rounds">{head}{body}</table>'


def sentences_html(sentences: list[Sentence]) -> str:
    out, section = [], None
    for s in sentences:
        if s.section != section:
            if section is not None:
                out.append("</ul>")
            out.append(f"<h3>{_e(s.section)}</h3><ul>")
            section = s.section
        tag = f'<span class="tag {_e(s.severity)}">{_e(s.kind)}</span>'
        out.append(f'<li class="{_e(s.severity)}">{tag} {_e(s.text)}</li>')
    if section is not None:
        out.append("</ul>")
    return "".join(out)


def page(
    data: StudyData, best_row: dict | None, plots: list[tuple[str, str, str]], sentences: list[Sentence]
) -> str:
    best = best_row["trial_name"] if best_row else None
    images = "".join(
        f'<h3>{_e(t)}</h3><img alt="{_e(t)}" src="{uri}">' + (f'<p class="caption">{_e(c)}</p>' if c else "")
        for t, uri, c in plots
    )
    return (
        '<!DOCTYPE html><html><head><meta charset="utf-8">'
        f"<title>study {_e(data.study.name)}</title><style>{STYLE}</style></head><body>"
        f"<h1>study {_e(data.study.name)}</h1>{header(data, best_row)}"
        f"<h2>rounds</h2>{rounds_table(data)}"
        f"<h2>playbook verdicts</h2>{sentences_html(sentences)}"
        f"<h2>trials</h2>{trial_table(data, best)}"
        f"<h2>plots</h2>{images}"
        f"<p><small>generated {_e(time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime()))} "
        f"from {_e(data.study_uri)}</small></p><script>{SORT_SCRIPT}</script></body></html>"
    )
