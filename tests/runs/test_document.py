"""kvfid.reports.document: one block list rendered as Markdown, one self-contained HTML page and
aligned text; the tuple blocks of the run report are the same blocks; one set of formatters."""

import re

import pytest

from kvfid.reports.compile_report import render_table as compile_table
from kvfid.runs.summary import Rate
from kvfid.reports.document import (Bullets, Code, Details, Figure, Heading, Link, Paragraph,
                                      Table, fraction, interval_text, markdown, number, percent,
                                      plain_text, ratio, seconds, to_html)

SVG = '<svg viewBox="0 0 10 10"><circle cx="5" cy="5" r="2"/></svg>'
DOC = [Heading("Title <1>"), Paragraph("Run `kvfid compare A B`: **REGRESSED** & more."),
       Heading("Part", 2),
       Table(["name", "value | bar"], [["a", 1], [Link("report", "x/report.md", "x/report.html"),
                                                 "two\nlines"]]),
       Bullets(["one", [Link("kernels", "k.md"), " table"]]), Code("kvfid run <case>"),
       Figure(SVG, "a dot"), Details("the numbers", Table(["k"], [[0.5]]))]


def test_markdown_keeps_marks_escapes_cells_and_leaves_figures_to_the_html():
    text = markdown(DOC)
    assert text.startswith("# Title <1>\n\nRun `kvfid compare A B`: **REGRESSED** & more.\n")
    assert "| name | value \\| bar |\n|---|---|\n| a | 1 |\n" \
           "| [report](x/report.md) | two lines |" in text
    assert "- one\n- [kernels](k.md) table" in text
    assert "```\nkvfid run <case>\n```" in text
    assert "| k |\n|---|\n| 0.5 |" in text       # a folded block shows as it is
    assert "<svg" not in text and "a dot" not in text


def test_html_is_one_escaped_self_contained_page_with_marks_and_links():
    page = to_html(DOC)
    assert page.startswith("<!DOCTYPE html>") and "<title>Title &lt;1&gt;</title>" in page
    assert "<p>Run <code>kvfid compare A B</code>: <strong>REGRESSED</strong> &amp; more.</p>" \
        in page
    assert '<td><a href="x/report.html">report</a></td>' in page      # the HTML twin
    assert '<li><a href="k.md">kernels</a> table</li>' in page
    assert "<pre>kvfid run &lt;case&gt;</pre>" in page
    assert f"<figure>{SVG}<figcaption>a dot</figcaption></figure>" in page
    assert "<details><summary>the numbers</summary><table>" in page
    assert "`" not in page and "**" not in page
    assert not re.search(r"\bsrc\s*=|<script|<link|url\(", page)


def test_plain_text_aligns_tables_for_a_terminal():
    text = plain_text([Paragraph("p"), Table(["a", "bb"], [[1, "xyz"], ["long", 2]]),
                       Figure(SVG, "gone")])
    assert text == "p\n\na     bb\n----  ---\n1     xyz\nlong  2\n"


def test_the_run_reports_tuple_blocks_render_as_the_same_blocks():
    tuples = [("h1", "T"), ("h3", "t"), ("p", "x"), ("pre", "y"), ("table", ["h"], [["c"]]),
              ("figure", SVG, "cap"), ("details", "d", ("pre", "z"))]
    blocks = [Heading("T"), Heading("t", 3), Paragraph("x"), Code("y"), Table(["h"], [["c"]]),
              Figure(SVG, "cap"), Details("d", Code("z"))]
    assert markdown(tuples) == markdown(blocks) and to_html(tuples) == to_html(blocks)
    with pytest.raises(ValueError, match="unknown report block"):
        markdown([("h9", "x")])


def test_one_set_of_formatters():
    assert (number(None), number(0.0), number(0.015625), number(3, ".2f")) == \
        ("n/a", "0", "0.0156", "3.00")
    assert (percent(None), percent(0.125)) == ("n/a", "12.5%")
    rate = Rate(1, 8, 0.125, (0.022, 0.471))
    assert interval_text(rate) == "1/8 (12.5%) [2.2%, 47.1%]" and interval_text(None) == "-"
    assert (fraction(rate), fraction(rate, rate=True), fraction(None)) == \
        ("1/8", "1/8 (12.5%)", "-")
    assert [seconds(x) for x in (None, 2.5, 1.3e-3, 4e-5, 7e-9)] == \
        ["-", "2.5 s", "1.3 ms", "40 us", "7 ns"]
    assert (ratio(None), ratio(1.304)) == ("-", "1.30")


def test_the_compile_table_goes_through_the_engine():
    floor = [{"gpu": "H100", "floor_us": 1.5, "bound": "memory", "shape": "[1, 64]"}]
    report = {"ok": False, "triton": "3.9.0", "jobs": 2, "seconds": 3.1, "configs": [
        {"name": "mm_sm_90", "arch": "sm_90", "num_warps": 8, "num_stages": 3, "registers": 255,
         "stack": 16, "shared": 1024, "mma": 0, "ffma": 10, "atomics": 0, "stl": 2, "ldl": 2,
         "roofline": floor, "problems": ["spills: 16 B stack, 2 STL / 2 LDL"]},
        {"name": "mm_sm_100", "arch": "sm_100", "error": "CompilationError: boom",
         "problems": ["compile failed: CompilationError: boom"], "roofline": []}]}
    text = compile_table(report)
    head, rule, first, second = text.splitlines()[:4]
    assert head.split() == ["config", "w/s", "regs", "stack", "shared", "MMA", "FFMA", "atom",
                            "STL/LDL", "roofline", "floor", "per", "launch"]
    assert first.split()[:9] == ["mm_sm_90", "8/3", "255", "16", "1024", "0", "10", "0", "2/2"]
    assert "[1, 64]: H100 1.5 us (mem)" in first and second.split()[:2] == ["mm_sm_100", "FAILED"]
    assert "- mm_sm_90: spills: 16 B stack, 2 STL / 2 LDL" in text
    assert "- sm_100: 0 of 1 configs pass; cannot compile for sm_100 here: CompilationError: boom" \
        in text
    assert text.endswith("triton 3.9.0, 2 workers, 3.1 s; FAILED")
