"""The run report's figures: inline SVG, drawn here with no plotting library.

`svg_lines` draws median d_rel per layer on a log axis (bit-exact layers on a band marked 0);
`svg_bars` draws grouped histograms (first-divergence index); `svg_curves` draws points on
log-log axes (the bench report's scale curve). Each returns one `<svg>` element that a
self-contained HTML page embeds (kvfid.reports.report, kvfid.reports.benchreport).
"""

from __future__ import annotations

import html
import math

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2",
           "#17becf")
_W, _H, _L, _R, _T, _B = 720, 300, 64, 190, 16, 44


def _frame(xlabel: str, ylabel: str, body: list[str], legend: list[tuple[str, str, str]]) -> str:
    parts = [f'<svg viewBox="0 0 {_W} {_H}" width="{_W}" height="{_H}" role="img" '
             f'font-family="sans-serif" font-size="11">',
             f'<rect x="{_L}" y="{_T}" width="{_W - _L - _R}" height="{_H - _T - _B}" '
             f'fill="none" stroke="#999"/>', *body,
             f'<text x="{(_L + _W - _R) / 2}" y="{_H - 8}" text-anchor="middle">'
             f'{html.escape(xlabel)}</text>',
             f'<text transform="translate(14 {(_T + _H - _B) / 2}) rotate(-90)" '
             f'text-anchor="middle">{html.escape(ylabel)}</text>']
    for i, (name, color, dash) in enumerate(legend):
        y = _T + 10 + 16 * i
        parts.append(f'<line x1="{_W - _R + 12}" x2="{_W - _R + 36}" y1="{y}" y2="{y}" '
                     f'stroke="{color}" stroke-width="2" stroke-dasharray="{dash}"/>'
                     f'<text x="{_W - _R + 42}" y="{y + 4}">{html.escape(name)}</text>')
    return "".join(parts) + "</svg>"


def svg_lines(series: list[tuple[str, list]], xlabel: str, ylabel: str) -> str:
    """Lines on a log y axis; zero (bit-exact) values sit on a band below it, marked `0`."""
    values = [y for _, ys in series for y in ys if y]
    n = max((len(ys) for _, ys in series), default=1)
    lo = math.floor(math.log10(min(values))) if values else -8
    hi = max(lo + 1, math.ceil(math.log10(max(values)))) if values else -7
    span, zero = _H - _T - _B - 24, _H - _B - 6          # 24 px below the lowest decade: 0
    x = lambda i: _L + 10 + (_W - _L - _R - 20) * (i / max(1, n - 1))
    y = lambda v: _T + span * (1 - (math.log10(v) - lo) / (hi - lo)) if v else zero
    body = [f'<line x1="{_L}" x2="{_W - _R}" y1="{zero}" y2="{zero}" stroke="#eee"/>'
            f'<text x="{_L - 4}" y="{zero + 4}" text-anchor="end">0</text>']
    for e in range(lo, hi + 1):
        body.append(f'<line x1="{_L}" x2="{_W - _R}" y1="{y(10.0 ** e):.1f}" '
                    f'y2="{y(10.0 ** e):.1f}" stroke="#eee"/><text x="{_L - 4}" '
                    f'y="{y(10.0 ** e) + 4:.1f}" text-anchor="end">1e{e}</text>')
    step = max(1, math.ceil(n / 16))
    for i in range(0, n, step):
        body.append(f'<text x="{x(i):.1f}" y="{_H - _B + 14}" text-anchor="middle">{i}</text>')
    legend = []
    for k, (name, ys) in enumerate(series):
        color, dash = PALETTE[(k // 2) % len(PALETTE)], "" if k % 2 == 0 else "5 3"
        points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(ys) if v is not None)
        body.append(f'<polyline points="{points}" fill="none" stroke="{color}" '
                    f'stroke-width="1.6" stroke-dasharray="{dash}"/>')
        for i, v in enumerate(ys):
            if v is not None:
                fill = "white" if not v else color
                body.append(f'<circle cx="{x(i):.1f}" cy="{y(v):.1f}" r="2.5" fill="{fill}" '
                            f'stroke="{color}"/>')
        legend.append((name, color, dash))
    return _frame(xlabel, ylabel, body, legend)


def svg_bars(histograms: dict[str, list], xlabel: str, ylabel: str = "suffixes",
             labels: list[str] | None = None) -> str:
    """Grouped bars: one colour per series, bins [lo, hi) shared by all series; `labels` name
    the bins instead of their bounds (the replay's |delta logprob| decades)."""
    edges = next((h for h in histograms.values() if h), [])
    top = max((count for h in histograms.values() for _, _, count in h), default=1) or 1
    width = (_W - _L - _R) / max(1, len(edges))
    bar = width * 0.8 / max(1, len(histograms))
    body = []
    for t in range(0, top + 1, max(1, math.ceil(top / 5))):
        yy = _H - _B - (_H - _T - _B) * t / top
        body.append(f'<line x1="{_L}" x2="{_W - _R}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#eee"/>'
                    f'<text x="{_L - 4}" y="{yy + 4:.1f}" text-anchor="end">{t}</text>')
    for b, (lo, hi, _) in enumerate(edges):
        label = labels[b] if labels else str(lo) if hi == lo + 1 else f"{lo}-{hi - 1}"
        body.append(f'<text x="{_L + width * (b + 0.5):.1f}" y="{_H - _B + 14}" '
                    f'text-anchor="middle">{label}</text>')
    legend = []
    for k, (name, h) in enumerate(histograms.items()):
        color = PALETTE[k % len(PALETTE)]
        legend.append((name, color, ""))
        for b, (_, _, count) in enumerate(h):
            height = (_H - _T - _B) * count / top
            body.append(f'<rect x="{_L + width * b + width * 0.1 + bar * k:.1f}" '
                        f'y="{_H - _B - height:.1f}" width="{bar:.1f}" height="{height:.1f}" '
                        f'fill="{color}"><title>{html.escape(name)}: {count}</title></rect>')
    return _frame(xlabel, ylabel, body, legend)


def svg_curves(series: list[tuple[str, list[tuple[float, float]]]], xlabel: str, ylabel: str) -> str:
    """(x, y) points per series on log-log axes, x ticks at the points' x values (the bench's
    scale curve: step median by prefix length)."""
    points = [(x, y) for _, pts in series for x, y in pts if x > 0 and y > 0]
    if not points:
        return _frame(xlabel, ylabel, [], [])
    log = lambda v: math.log10(v)  # noqa: E731
    xs = sorted({x for x, _ in points})
    x_lo, x_hi = log(xs[0]), max(log(xs[-1]), log(xs[0]) + 1e-9)
    y_lo = math.floor(log(min(y for _, y in points)))
    y_hi = max(y_lo + 1, math.ceil(log(max(y for _, y in points))))
    px = lambda v: _L + 14 + (_W - _L - _R - 28) * (log(v) - x_lo) / (x_hi - x_lo)  # noqa: E731
    py = lambda v: _T + (_H - _T - _B) * (1 - (log(v) - y_lo) / (y_hi - y_lo))  # noqa: E731
    body = []
    for e in range(y_lo, y_hi + 1):
        body.append(f'<line x1="{_L}" x2="{_W - _R}" y1="{py(10.0 ** e):.1f}" y2="{py(10.0 ** e):.1f}" '
                    f'stroke="#eee"/><text x="{_L - 4}" y="{py(10.0 ** e) + 4:.1f}" '
                    f'text-anchor="end">1e{e}</text>')
    body += [f'<text x="{px(x):.1f}" y="{_H - _B + 14}" text-anchor="middle">{x:g}</text>' for x in xs]
    legend = []
    for k, (name, pts) in enumerate(series):
        color, dash = PALETTE[(k // 2) % len(PALETTE)], "" if k % 2 == 0 else "5 3"
        kept = [(x, y) for x, y in sorted(pts) if x > 0 and y > 0]
        body.append(f'<polyline points="{" ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in kept)}" '
                    f'fill="none" stroke="{color}" stroke-width="1.6" stroke-dasharray="{dash}"/>')
        body += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{color}">'
                 f'<title>{html.escape(name)}: {x:g}, {y:.3g}</title></circle>' for x, y in kept]
        legend.append((name, color, dash))
    return _frame(xlabel, ylabel, body, legend)


def svg_shares(series: list[tuple[str, list[tuple[float, float]]]], xlabel: str, ylabel: str) -> str:
    """(x, share) points per series: x on a log axis, ticks at the points' x values; the share
    on a linear axis from 0 to 1, zeros drawn (the load sweep: requests differing by co-residents)."""
    xs = sorted({x for _, pts in series for x, _ in pts if x > 0})
    if not xs:
        return _frame(xlabel, ylabel, [], [])
    log = math.log10
    x_lo, x_hi = log(xs[0]), max(log(xs[-1]), log(xs[0]) + 1e-9)
    px = lambda v: _L + 14 + (_W - _L - _R - 28) * (log(v) - x_lo) / (x_hi - x_lo)  # noqa: E731
    py = lambda v: _T + (_H - _T - _B) * (1 - v)  # noqa: E731
    body = [f'<line x1="{_L}" x2="{_W - _R}" y1="{py(v):.1f}" y2="{py(v):.1f}" stroke="#eee"/>'
            f'<text x="{_L - 4}" y="{py(v) + 4:.1f}" text-anchor="end">{v:g}</text>'
            for v in (0.0, 0.25, 0.5, 0.75, 1.0)]
    body += [f'<text x="{px(x):.1f}" y="{_H - _B + 14}" text-anchor="middle">{x:g}</text>' for x in xs]
    legend = []
    for k, (name, pts) in enumerate(series):
        color, dash = PALETTE[(k // 2) % len(PALETTE)], "" if k % 2 == 0 else "5 3"
        kept = [(x, y) for x, y in sorted(pts) if x > 0]
        body.append(f'<polyline points="{" ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in kept)}" '
                    f'fill="none" stroke="{color}" stroke-width="1.6" stroke-dasharray="{dash}"/>')
        body += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{"white" if not y else color}" '
                 f'stroke="{color}"><title>{html.escape(name)}: {x:g}, {y:.3g}</title></circle>'
                 for x, y in kept]
        legend.append((name, color, dash))
    return _frame(xlabel, ylabel, body, legend)
