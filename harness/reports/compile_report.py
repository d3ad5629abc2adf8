"""The `kvfid compile` report as a document: resources, instruction mix, roofline floors, problems.

What is compiled and judged is kvfid.environment.compile; this module only lays its result out.
"""

from __future__ import annotations

from kvfid.reports.document import Bullets, Paragraph, Table, plain_text


def _floors(row: dict) -> str:
    return ", ".join(f"{r['gpu']} {r['floor_us']:g} us ({r['bound'][:3]})" for r in row["roofline"])


def compile_document(report: dict) -> list:
    """The report as blocks of kvfid.reports.document: resources, instruction mix, roofline
    floors, then each problem, each arch's count and the verdict."""
    rows, found = [], []
    for row in report["configs"]:
        if "error" in row:
            rows.append([row["name"], "FAILED"] + ["-"] * 8)
        else:
            shape = row["roofline"][0]["shape"] if row["roofline"] else ""
            rows.append([row["name"], f"{row['num_warps']}/{row['num_stages']}",
                         row["registers"], row["stack"], row["shared"], row["mma"], row["ffma"],
                         row["atomics"], f"{row['stl']}/{row['ldl']}",
                         f"{shape}: {_floors(row)}"])
        found += [f"{row['name']}: {problem}" for problem in row["problems"]]
    doc = [Table(["config", "w/s", "regs", "stack", "shared", "MMA", "FFMA", "atom", "STL/LDL",
                  "roofline floor per launch"], rows)]
    if found:
        doc.append(Bullets(found))
    counts = []
    for arch in dict.fromkeys(r["arch"] for r in report["configs"]):
        of_arch = [r for r in report["configs"] if r["arch"] == arch]
        bad = [r for r in of_arch if r["problems"]]
        line = f"{arch}: {len(of_arch) - len(bad)} of {len(of_arch)} configs pass"
        if of_arch and all("error" in r for r in of_arch):
            line += f"; cannot compile for {arch} here: {of_arch[0]['error']}"
        counts.append(line)
    return doc + [Bullets(counts),
                  Paragraph(f"triton {report['triton']}, {report['jobs']} workers, "
                            f"{report['seconds']} s; {'ok' if report['ok'] else 'FAILED'}")]


def render_table(report: dict) -> str:
    """The report for a terminal: aligned columns, then problems, counts per arch, the verdict."""
    return plain_text(compile_document(report)).rstrip("\n")
