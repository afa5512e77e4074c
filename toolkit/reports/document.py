"""The report document: what a report accumulates (sections in HTML and Markdown, tables,
figures, findings, the recording's notices), how values are shown (human units), and how it is
written (``report.html`` with every figure embedded, ``REPORT.md``, ``report.json``, the tables as
Parquet and JSON), staged so a failed report leaves an earlier one untouched.

Page order: the title, the findings panel (what the report found, every number a link to the
table row it comes from), the recording (the run's header and its notices, folded), then the
sections. A table shows its first rows; the rest fold under "all N rows", the whole table is
tables/NAME.parquet and .json.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as _dt
import html
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from moetrace.version import __version__
from moetrace.errors import UsageError
from moetrace.inputs.geometry import format_bytes
from moetrace.jsonutil import json_default

TOP_N = 15  # rows a long table shows (unfolded: FIRST_ROWS)
FIRST_ROWS = 5


# -- values as a person reads them -------------------------------------------------------------------

def is_na(v) -> bool:
    if v is None or v is pd.NA:
        return True
    try:
        return bool(pd.isna(v))
    except (TypeError, ValueError):
        return False


def fmt_bytes(n) -> str:
    return "NA" if is_na(n) else format_bytes(float(n))


def fmt_num(v, digits: int = 3) -> str:
    if is_na(v):
        return "NA"
    if isinstance(v, (bool, np.bool_)):
        return "yes" if v else "no"
    if isinstance(v, (int, np.integer)):
        return f"{int(v):,}"
    if isinstance(v, (float, np.floating)):
        if float(v).is_integer() and abs(v) >= 1000:
            return f"{int(v):,}"
        return f"{v:.{digits}g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def fmt_ms(ns) -> str:
    """A duration given in ns, in the unit a person reads it in."""
    if is_na(ns):
        return "NA"
    ns = float(ns)
    if abs(ns) >= 1e9:
        return f"{ns / 1e9:.3g} s"
    if abs(ns) >= 1e6:
        return f"{ns / 1e6:.3g} ms"
    if abs(ns) >= 1e3:
        return f"{ns / 1e3:.3g} µs"
    return f"{ns:.3g} ns"


def fmt_pct(v) -> str:
    return "NA" if is_na(v) else f"{100 * float(v):.3g} %"


def show_value(column: str, v) -> str:
    """A table cell in human units, chosen by the column's name: *_bytes as KiB / MiB / GiB,
    *_ns as ns / µs / ms / s, *_share / *_rate / *_fraction as %; else numbers with separators."""
    col = str(column)
    if is_na(v):
        return "NA"
    if isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_)):
        if col.endswith("_bytes") or col == "bytes":
            return fmt_bytes(v)
        if col.endswith("_ns") or "_ns_" in col and not col.endswith("per_kib"):
            return fmt_ms(v)
        if col.endswith(("_share", "_rate", "_fraction")):
            return fmt_pct(v)
    return fmt_num(v)


def shown_frame(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` as the strings a table shows (:func:`show_value` per column)."""
    out = pd.DataFrame(index=range(len(df)))
    for c in df.columns:
        out[str(c)] = [show_value(c, v) for v in df[c].astype(object)]
    return out


def md_table(df: pd.DataFrame, max_rows: int | None = None) -> str:
    d = df if max_rows is None else df.head(max_rows)
    cols = [str(c) for c in d.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for row in d.itertuples(index=False):
        lines.append("| " + " | ".join(str(v).replace("|", "\\|") for v in row) + " |")
    if max_rows is not None and len(df) > max_rows:
        lines.append(f"\n({len(df) - max_rows} more rows in the table file)")
    return "\n".join(lines)


def html_table(df: pd.DataFrame, name: str | None = None, cls: str = "",
               links: dict[str, list[str | None]] | None = None) -> str:
    """``df`` (strings) as an HTML table; ``name`` marks it (data-table) and its rows (data-row)
    for the findings' links; ``links`` makes a column's cells links (href per row, None: none)."""
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in df.columns)
    links = links or {}
    cols = [str(c) for c in df.columns]

    def td(col: str, i: int, v) -> str:
        href = links[col][i] if col in links and i < len(links[col]) else None
        text = html.escape(str(v))
        return f"<td><a href='{html.escape(href)}'>{text}</a></td>" if href else f"<td>{text}</td>"

    body = []
    for i, row in enumerate(df.itertuples(index=False)):
        body.append(f"<tr data-row='{i}'>" + "".join(td(c, i, v) for c, v in zip(cols, row)) + "</tr>")
    attrs = (f" data-table='{html.escape(name)}'" if name else "") + (f" class='{cls}'" if cls else "")
    return f"<table{attrs}><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def folded_table(shown: pd.DataFrame, name: str | None, total: int, file: str | None,
                 links: dict[str, list[str | None]] | None = None) -> str:
    """The first rows of ``shown``; the rest (up to all of ``shown``) folded under a summary; a link
    to the whole table when the file holds more than shown."""
    link = (f" <a href='{file}'>whole table ({total} rows): {file}</a>" if file else "")
    if len(shown) <= FIRST_ROWS + 2:
        more = f"<p class='more'>{link}</p>" if file and total > len(shown) else ""
        return html_table(shown, name, "all", links) + more
    return (html_table(shown.head(FIRST_ROWS), None, "", links) +
            f"<details><summary>all {len(shown)} rows shown here"
            f"{f' of {total}' if total > len(shown) else ''}</summary>{html_table(shown, name, 'all', links)}</details>"
            + (f"<p class='more'>{link}</p>" if file else ""))


# -- the document being built ------------------------------------------------------------------------

@dataclass
class Report:
    """What a report accumulates: HTML and Markdown parts, tables (and the strings they show),
    figures, findings, the recording's header and notices, headline figures."""

    out: Path
    title: str
    html: list[str] = field(default_factory=list)
    md: list[str] = field(default_factory=list)
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    shown: dict[str, pd.DataFrame] = field(default_factory=dict)
    figures: dict[str, bytes] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    findings: list[tuple[str, str]] = field(default_factory=list)  # (html, markdown)
    recording: list[tuple[str, str]] = field(default_factory=list)  # (html, markdown) of the header

    def h(self, level: int, text: str, anchor: str | None = None) -> None:
        a = f" id='{anchor}'" if anchor else ""
        self.html.append(f"<h{level}{a}>{html.escape(text)}</h{level}>")
        self.md.append("#" * level + " " + text + "\n")

    def p(self, text: str) -> None:
        self.html.append(f"<p>{html.escape(text)}</p>")
        self.md.append(text + "\n")

    def table(self, name: str, df: pd.DataFrame, caption: str, max_rows: int | None = TOP_N,
              show: pd.DataFrame | None = None, shown: pd.DataFrame | None = None,
              links: dict[str, list[str | None]] | None = None, fold: bool = False) -> None:
        """Keep ``df`` as tables/NAME.*; show ``show`` (default df) up to max_rows rows in human
        units (or ``shown``, strings already), its first rows unfolded; ``fold``: all of it folded
        under its caption (the data behind a figure)."""
        self.tables[name] = df
        s = shown if shown is not None else shown_frame((df if show is None else show).head(
            max_rows if max_rows is not None else len(df)))
        self.shown[name] = s
        file = f"tables/{name}.json"
        if fold:
            self.html.append(f"<div class='tbl' id='t-{name}'><details><summary>{html.escape(caption)} "
                             f"({len(df)} rows)</summary>{html_table(s, name, 'all', links)}"
                             f"<p class='more'><a href='{file}'>whole table: {file}</a></p></details></div>")
        else:
            self.html.append(f"<div class='tbl' id='t-{name}'><p class='cap'>{html.escape(caption)}</p>"
                             f"{folded_table(s, name, len(df), file, links)}</div>")
        self.md.append(f"*{caption}* (`tables/{name}.parquet`)\n\n{md_table(s, TOP_N)}\n")

    def kv(self, rows: list[tuple[str, Any]], name: str | None = None, target: list[str] | None = None,
           md_target: list[str] | None = None) -> None:
        """A figure / value table; ``name`` makes its values linkable by findings (row: position)."""
        df = pd.DataFrame({"figure": [r[0] for r in rows],
                           "value": [v if isinstance(v, str) else fmt_num(v) for _, v in rows]})
        if name:
            self.shown[name] = df
        (self.html if target is None else target).append(
            f"<div id='t-{name}'>{html_table(df, name, 'all')}</div>" if name else html_table(df))
        (self.md if md_target is None else md_target).append(md_table(df) + "\n")

    def figure(self, name: str, png: bytes, caption: str, wide: bool = False) -> None:
        self.figures[name] = png
        b64 = base64.b64encode(png).decode()
        cls = " class='wide'" if wide else ""
        self.html.append(f"<figure{cls} id='f-{name}'><img alt='{html.escape(caption)}' "
                         f"src='data:image/png;base64,{b64}'/><figcaption>{html.escape(caption)}</figcaption></figure>")
        self.md.append(f"![{caption}](figures/{name}.png)\n")

    def raw_svg(self, svg: str, caption: str, file: str) -> None:
        body = svg[svg.find("<svg"):] if "<svg" in svg else svg
        self.html.append(f"<figure class='svg wide'>{body}<figcaption>{html.escape(caption)} "
                         f"(<a href='{file}'>{file}</a>)</figcaption></figure>")
        self.md.append(f"[{caption}]({file})\n")

    def fig(self, table: str, row: int, column: str) -> tuple[str, str]:
        """The value a table shows at (row, column), as a finding quotes it: (HTML link to the
        table, Markdown text). KeyError when the table or cell is not shown."""
        df = self.shown[table]
        text = str(df[column].iloc[row])
        return (f"<a class='fig' href='#t-{html.escape(table)}' data-table='{html.escape(table)}' "
                f"data-row='{row}' data-col='{html.escape(column)}'>{html.escape(text)}</a>", text)

    def finding(self, *parts: str | tuple[str, str], cls: str = "") -> None:
        """One finding: text and :meth:`fig` values, in order."""
        h = "".join(html.escape(p) if isinstance(p, str) else p[0] for p in parts)
        m = "".join(p if isinstance(p, str) else p[1] for p in parts)
        self.findings.append((f"<li class='{cls}'>{h}</li>" if cls else f"<li>{h}</li>", f"- {m}"))


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:1.5em auto;max-width:1200px;color:#222;padding:0 1em}
h1{font-size:1.5em;margin-bottom:.2em} h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.6em}
h3{margin-top:1.2em}
table{border-collapse:collapse;font-size:.85em;margin:.4em 0} th,td{border:1px solid #ddd;padding:.15em .5em;text-align:right}
th{background:#f4f4f4} td:first-child,th:first-child{text-align:left}
figure{margin:.5em 0;display:inline-block;width:49%;vertical-align:top} figure.wide{width:100%;display:block}
figure img{max-width:100%;border:1px solid #eee} figcaption{font-size:.8em;color:#555}
.cap{font-weight:600;margin:.6em 0 .1em} .more{font-size:.8em;color:#777;margin:.1em 0}
details>summary{cursor:pointer;font-size:.85em;color:#555}
nav a{margin-right:1em} .note{background:#fff8e1;padding:.3em .5em;border-left:3px solid #f0b400;margin:.3em 0}
.alarm{background:#fdecea;border-left:3px solid #d93025;padding:.5em} .ok{background:#e6f4ea;border-left:3px solid #188038;padding:.5em}
#findings{background:#f6f8fb;border:1px solid #d5dbe5;padding:.4em 1.2em .6em;border-radius:4px}
#findings h2{margin-top:.4em;border:none} #findings li{margin:.35em 0;line-height:1.45}
#findings li.alarm{padding:.3em .5em} #findings li.ok{padding:.3em .5em}
a.fig{font-weight:600;color:#0b57d0;text-decoration:none;border-bottom:1px dotted #0b57d0}
figure.svg svg{max-width:100%;height:auto}
.tbl{overflow-x:auto;max-width:100%}
"""


def _findings_html(rep: Report) -> str:
    if not rep.findings:
        return ""
    return ("<section id='findings'><h2>Findings</h2><ul>" + "".join(h for h, _ in rep.findings)
            + "</ul></section>")


def _recording_html(rep: Report) -> str:
    if not rep.recording and not rep.notes:
        return ""
    notes = "".join(f"<p class='note'>{html.escape(n)}</p>" for n in rep.notes)
    head = "".join(h for h, _ in rep.recording)
    n = f" ({len(rep.notes)} notice{'s' if len(rep.notes) != 1 else ''})" if rep.notes else ""
    return (f"<section id='recording'><details><summary><b>Recording</b>: what was recorded, how{n}</summary>"
            f"{head}{notes}</details></section>")


def write_report(rep: Report, sections: Iterable[str], final: Path | None = None) -> dict[str, Any]:
    """Write the report into ``rep.out`` (a staging directory); the paths in the returned
    document are those in ``final`` (where :func:`staged` moves it), default ``rep.out``."""
    out = rep.out
    final = final or out
    (out / "tables").mkdir(parents=True, exist_ok=True)
    (out / "figures").mkdir(parents=True, exist_ok=True)
    for name, df in rep.tables.items():
        df.to_parquet(out / "tables" / f"{name}.parquet", index=False)
        (out / "tables" / f"{name}.json").write_text(table_json(df))
    for name, png in rep.figures.items():
        (out / "figures" / f"{name}.png").write_bytes(png)
    nav = "".join(f"<a href='#{s}'>{s}</a>" for s in (["findings"] if rep.findings else []) + list(sections))
    page = (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(rep.title)}</title>"
            f"<style>{CSS}</style></head><body><h1>{html.escape(rep.title)}</h1><nav>{nav}</nav>"
            + _findings_html(rep) + _recording_html(rep) + "\n".join(rep.html)
            + f"<hr><p class='more'>moetrace {__version__}, "
              f"{_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}</p></body></html>\n")
    (out / "report.html").write_text(page)
    md = (f"# {rep.title}\n\n" + ("## Findings\n\n" + "\n".join(m for _, m in rep.findings) + "\n\n"
                                  if rep.findings else "")
          + ("## Recording\n\n" + "".join(m for _, m in rep.recording) + "".join(f"> {n}\n\n" for n in rep.notes)
             if rep.recording or rep.notes else "")
          + "\n".join(rep.md))
    (out / "REPORT.md").write_text(md)
    doc = {"schema": "moetrace.report/1", "title": rep.title, "summary": rep.summary,
           "findings": [m[2:] for _, m in rep.findings],
           "tables": sorted(rep.tables), "figures": sorted(rep.figures), "files": rep.files, "notes": rep.notes,
           "html": str(final / "report.html"), "markdown": str(final / "REPORT.md")}
    (out / "report.json").write_text(json.dumps(doc, indent=1, default=json_default) + "\n")
    return doc


def table_json(df: pd.DataFrame) -> str:
    """Records JSON with NA as null and floats rounded to 9 significant digits (stable
    across platforms for golden files)."""
    def conv(v):
        if v is None or v is pd.NA:
            return None
        if isinstance(v, (np.integer,)):
            return int(v)
        if isinstance(v, (float, np.floating)):
            return None if math.isnan(v) else float(f"{float(v):.9g}")
        if isinstance(v, (np.bool_,)):
            return bool(v)
        return v

    recs = [{str(k): conv(v) for k, v in zip(df.columns, row)} for row in df.astype(object).itertuples(index=False)]
    if not recs:
        return "[]\n"
    return "[\n" + ",\n".join(json.dumps(r, default=json_default) for r in recs) + "\n]\n"  # a row a line


# -- where it is written -------------------------------------------------------------------------------

def prepare_out(out: Path, force: bool) -> None:
    """Refuse a non-empty ``out`` that holds no earlier report (unless ``force``); nothing is
    changed there until the new report is complete (:func:`staged`)."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out} exists and is not a directory", hint="choose another --out")
    if out.exists() and any(out.iterdir()):
        if not (out / "report.json").exists() and not force:
            raise UsageError(f"{out} exists, is not empty and holds no earlier report",
                             hint="choose another --out, or pass --force")


def merge_into(src: Path, dst: Path) -> None:
    """Move every file under ``src`` to the same place under ``dst`` (replacing namesakes)."""
    dst.mkdir(exist_ok=True)
    for entry in sorted(src.iterdir()):
        d = dst / entry.name
        if entry.is_dir() and not entry.is_symlink():
            merge_into(entry, d)
        else:
            os.replace(entry, d)


@contextlib.contextmanager
def staged(out: Path, clear: tuple[str, ...] = ("tables", "figures")) -> Iterator[Path]:
    """A staging directory inside ``out`` (``.report.tmp-*``) to build a report in. When the
    block completes, the ``clear`` subdirectories of an earlier report are removed and every
    file built replaces its namesake in ``out``; when it raises, the staging directory goes
    (and ``out`` too if this created it, empty): a failed report leaves the earlier one
    untouched."""
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".report.tmp-", dir=out))
    try:
        yield stage
        for sub in clear:
            shutil.rmtree(out / sub, ignore_errors=True)
        merge_into(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        if created:
            try:
                out.rmdir()
            except OSError:
                pass
        raise
    shutil.rmtree(stage, ignore_errors=True)


