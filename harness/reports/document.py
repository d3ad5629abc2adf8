"""The one document engine: report blocks rendered as Markdown, one self-contained HTML page, or
aligned plain text, with one stylesheet and one set of number formatters.

Every report kvfid writes (run report, comparison, index, kernel table, bench table, compile
table) is a list of blocks: `Heading`, `Paragraph`, `Table`, `Bullets`, `Code`, `Figure` (raw
inline SVG), `Details` (a block the HTML folds away); a `Link` may stand in a paragraph, a list
item or a table cell. Text may carry two inline marks, `code` and **strong**: Markdown keeps them,
the HTML turns them into elements. Figures are drawn in kvfid.reports.figures and appear in the
HTML only; a report keeps their numbers in a table, so Markdown loses no data. The tuple blocks of
kvfid.reports.report (("h2", text), ("table", head, rows), ...) are accepted as they are.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from typing import Union

from kvfid.runs.summary import Rate


# --------------------------------------------------------------------------- formatters

def number(x, spec: str = ".3g") -> str:
    """A measured number (`n/a` when there is none); 0 prints as `0`."""
    return "n/a" if x is None else format(x, spec)


def percent(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def interval_text(r: Rate | None) -> str:
    """A rate with its 95% interval: `k/n (rate) [lo, hi]` (`-` when there is none)."""
    if not r:
        return "-"
    return f"{r.k}/{r.n} ({percent(r.rate)}) [{percent(r.ci[0])}, {percent(r.ci[1])}]"


def fraction(r: Rate | None, rate: bool = False) -> str:
    """`k/n` of a count, with its rate in parentheses when `rate`."""
    if not r:
        return "-"
    return f"{r.k}/{r.n}" + (f" ({percent(r.rate)})" if rate and r.rate is not None else "")


def seconds(x) -> str:
    """A duration in the unit that reads best (s, ms, us or ns), to three significant digits."""
    if x is None:
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x / 1e-9:.3g} ns"


def ratio(x) -> str:
    return "-" if x is None else f"{x:.2f}"


# --------------------------------------------------------------------------- blocks

@dataclass(frozen=True)
class Link:
    """Inline link. `html_href`: where the HTML page points instead (a report's .html beside
    the .md that the Markdown links)."""

    text: str
    href: str
    html_href: str | None = None


Inline = Union[str, Link, list]   # text, a link, or a run of both


@dataclass(frozen=True)
class Cell:
    """A table cell with a verdict (`bit-exact`, `cache-differs`, `diverges`, `none`) that the
    HTML colours; Markdown and text show the content alone, so it should say the verdict too."""

    content: Inline
    verdict: str


@dataclass(frozen=True)
class Heading:
    text: str
    level: int = 1


@dataclass(frozen=True)
class Paragraph:
    text: Inline


@dataclass(frozen=True)
class Table:
    """Cells are anything printable, or a Link."""

    head: list
    rows: list


@dataclass(frozen=True)
class Bullets:
    items: list


@dataclass(frozen=True)
class Code:
    """Preformatted text: a command, a JSON record, a description."""

    text: str


@dataclass(frozen=True)
class Figure:
    """Raw inline SVG and its caption; HTML only."""

    svg: str
    caption: str = ""


@dataclass(frozen=True)
class Details:
    """A block the HTML folds under `title`; Markdown and text show it as it is."""

    title: str
    block: object


def block(item) -> object:
    """A block from kvfid.reports.report's tuple form, or the block itself."""
    if not isinstance(item, tuple):
        return item
    kind = item[0]
    if kind in ("h1", "h2", "h3"):
        return Heading(item[1], int(kind[1]))
    simple = {"p": Paragraph, "pre": Code, "table": Table, "figure": Figure, "details": Details,
              "list": Bullets}
    if kind not in simple:
        raise ValueError(f"unknown report block {kind!r}")
    return simple[kind](*item[1:])


# --------------------------------------------------------------------------- Markdown

def _md_inline(x) -> str:
    if isinstance(x, Cell):
        return _md_inline(x.content)
    if isinstance(x, Link):
        return f"[{x.text}]({x.href})"
    if isinstance(x, list):
        return "".join(_md_inline(p) for p in x)
    return str(x)


def _md_cell(x) -> str:
    return _md_inline(x).replace("|", "\\|").replace("\n", " ")


def _md_block(b) -> str | None:
    if isinstance(b, Details):
        return _md_block(block(b.block))
    if isinstance(b, Heading):
        return "#" * b.level + " " + b.text
    if isinstance(b, Paragraph):
        return _md_inline(b.text)
    if isinstance(b, Code):
        return "```\n" + b.text + "\n```"
    if isinstance(b, Bullets):
        return "\n".join("- " + _md_inline(i).replace("\n", " ") for i in b.items)
    if isinstance(b, Table):
        return "\n".join(["| " + " | ".join(map(_md_cell, b.head)) + " |",
                          "|" + "---|" * len(b.head)]
                         + ["| " + " | ".join(map(_md_cell, r)) + " |" for r in b.rows])
    if isinstance(b, Figure):
        return None     # the HTML's; its numbers are in a table of the report
    raise ValueError(f"unknown report block {b!r}")


def markdown(doc: list) -> str:
    """Markdown for terminals and pull requests (figures are in the HTML; their data is here)."""
    parts = (_md_block(block(b)) for b in doc)
    return "\n\n".join(p for p in parts if p is not None) + "\n"


# --------------------------------------------------------------------------- HTML

CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:24px auto;padding:0 16px;
color:#222}table{border-collapse:collapse;margin:8px 0 16px;font-size:13px}
td,th{border:1px solid #ccc;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f3f3f3}pre{background:#f7f7f7;padding:8px;overflow-x:auto;font-size:12px;
white-space:pre-wrap;word-break:break-all}h2{border-bottom:1px solid #ddd;margin-top:32px}
figure{margin:8px 0 16px}figcaption{font-size:12px;color:#555}
summary{cursor:pointer;color:#555;font-size:13px;margin:4px 0}
code{background:#f3f3f3;padding:0 3px;font-size:92%}a{color:#0b57d0}ul{padding-left:22px}
table{max-width:100%}td{overflow-wrap:anywhere}th{overflow-wrap:break-word}td.v-bit-exact{background:#e3f4e6}
td.v-cache-differs{background:#fdf3d7}td.v-diverges{background:#fbe3e1}td.v-none{color:#888}"""

_CODE = re.compile(r"`([^`\n]+)`")
_STRONG = re.compile(r"\*\*([^*\n]+)\*\*")


def _html_text(text: str) -> str:
    escaped = html.escape(str(text))
    return _STRONG.sub(r"<strong>\1</strong>", _CODE.sub(r"<code>\1</code>", escaped))


def _html_inline(x) -> str:
    if isinstance(x, Cell):
        return _html_inline(x.content)
    if isinstance(x, Link):
        href = x.html_href or x.href
        return f'<a href="{html.escape(href, quote=True)}">{_html_text(x.text)}</a>'
    if isinstance(x, list):
        return "".join(_html_inline(p) for p in x)
    return _html_text(x)


def _html_block(b) -> str:
    if isinstance(b, Details):
        return (f"<details><summary>{html.escape(b.title)}</summary>"
                f"{_html_block(block(b.block))}</details>")
    if isinstance(b, Heading):
        return f"<h{b.level}>{_html_text(b.text)}</h{b.level}>"
    if isinstance(b, Paragraph):
        return f"<p>{_html_inline(b.text)}</p>"
    if isinstance(b, Code):
        return f"<pre>{html.escape(b.text)}</pre>"
    if isinstance(b, Bullets):
        return "<ul>" + "".join(f"<li>{_html_inline(i)}</li>" for i in b.items) + "</ul>"
    if isinstance(b, Table):
        head = "".join(f"<th>{_html_inline(h)}</th>" for h in b.head)
        rows = "".join("<tr>" + "".join(_html_cell(c) for c in r) + "</tr>" for r in b.rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"
    if isinstance(b, Figure):
        return f"<figure>{b.svg}<figcaption>{html.escape(b.caption)}</figcaption></figure>"
    raise ValueError(f"unknown report block {b!r}")


def _html_cell(c) -> str:
    verdict = f' class="v-{html.escape(c.verdict, quote=True)}"' if isinstance(c, Cell) else ""
    return f"<td{verdict}>{_html_inline(c)}</td>"


def to_html(doc: list) -> str:
    """One self-contained page: inline CSS and SVG, no external resource; links only to the
    files a block names."""
    doc = [block(b) for b in doc]
    title = next((b.text for b in doc if isinstance(b, Heading) and b.level == 1), "kvfid report")
    out = [f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>"
           f"{html.escape(title)}</title><style>{CSS}</style></head><body>"]
    out += [_html_block(b) for b in doc]
    return "\n".join(out) + "\n</body></html>\n"


# --------------------------------------------------------------------------- plain text

def text_table(head: list, rows: list) -> str:
    """Columns aligned with spaces, a dashed rule under the head (for a terminal)."""
    head, rows = [_md_inline(h) for h in head], [[_md_inline(c) for c in r] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _text_block(b) -> str | None:
    if isinstance(b, Details):
        return _text_block(block(b.block))
    if isinstance(b, Table):
        return text_table(b.head, b.rows)
    if isinstance(b, Bullets):
        return "\n".join("- " + _md_inline(i) for i in b.items)
    if isinstance(b, (Heading, Paragraph, Code)):
        return _md_inline(b.text)
    return None         # a figure


def plain_text(doc: list) -> str:
    """The document for a terminal: tables aligned, no Markdown table syntax, no figures."""
    parts = (_text_block(block(b)) for b in doc)
    return "\n\n".join(p for p in parts if p is not None) + "\n"
