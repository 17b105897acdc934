"""Line plots as SVG text, drawn without a plotting package (the device machines and CI have
none): the accelerator check's step times (accelerator_report.py) and the CPU comparison with
llama.cpp (bench_llama_cpp.py)."""
from __future__ import annotations

import math

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def line_svg(series: list[tuple[str, list[tuple[float, float]], bool]], x_label: str,
             y_label: str, empty: str = "nothing was measured", width: int = 640,
             height: int = 400) -> str:
    """`series`: (label, [(x, y)], dashed); x on a log2 scale, y from 0. A dashed series takes the
    colour of the solid one before it (a measurement and its floor)."""
    left, right, top, bottom = 60, 190, 20, 50
    points = [p for _, data, _ in series for p in data]
    if not points:
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">'
                f'<text x="20" y="40">{empty}</text></svg>\n')
    xs = [x for x, _ in points]
    low, high = math.log2(min(xs)), math.log2(max(xs))
    top_y = max(y for _, y in points) * 1.1 or 1.0

    def xy(x, y):
        span = (math.log2(x) - low) / ((high - low) or 1.0)
        return (left + span * (width - left - right),
                height - bottom - y / top_y * (height - top - bottom))

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           'font-family="sans-serif" font-size="12">',
           f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" '
           'stroke="black"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="black"/>',
           f'<text x="{(width - right + left) / 2}" y="{height - 10}" text-anchor="middle">'
           f'{x_label}</text>',
           f'<text x="15" y="{top + 10}">{y_label}</text>']
    for x in sorted(set(xs)):
        px, py = xy(x, 0)
        out.append(f'<text x="{px:.1f}" y="{py + 16:.1f}" text-anchor="middle">{x:g}</text>')
    for tick in (top_y / 4 * i for i in range(1, 5)):
        px, py = xy(min(xs), tick)
        out.append(f'<text x="{left - 5}" y="{py + 4:.1f}" text-anchor="end">{tick:.1f}</text>')
    color_index = -1
    for i, (label, data, dashed) in enumerate(series):
        color_index += 0 if dashed and i else 1
        color = COLORS[color_index % len(COLORS)]
        dash = ' stroke-dasharray="5,4"' if dashed else ""
        path = " ".join(f"{px:.1f},{py:.1f}" for px, py in (xy(x, y) for x, y in data))
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"'
                   f'{dash}/>')
        ly = top + 18 * i
        out.append(f'<line x1="{width - right + 10}" y1="{ly}" x2="{width - right + 30}" '
                   f'y2="{ly}" stroke="{color}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{width - right + 35}" y="{ly + 4}">{label}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
