"""Render the Grafana dashboard's panels as a PNG, from a real Prometheus, with matplotlib.

Grafana is not needed: each panel of deploy/grafana/dashboards/offloop.json is drawn
where the dashboard places it, from the same queries, answered by Prometheus's HTTP API
over the run's time span. Makes docs/img/dashboard.png (see docs/prometheus.md):

    python scripts/render_dashboard.py --prometheus http://127.0.0.1:9090 --run demo

Needs matplotlib (`pip install matplotlib`); nothing else in offloop does.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy/grafana/dashboards/offloop.json"
COLORS = ["#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9", "#fade2a"]
BACKGROUND, PANEL, TEXT, GRID = "#111217", "#181b1f", "#ccccdc", "#2c3235"


def api(base: str, path: str, **params) -> dict:
    url = f"{base.rstrip('/')}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.load(response)
    if body.get("status") != "success":
        sys.exit(f"render_dashboard: {url}: {body}")
    return body["data"]


def run_span(base: str, run: str) -> tuple[float, float]:
    """First and last scrape of the run's step series."""
    result = api(base, "query", query=f'offloop_step{{run="{run}"}}[1d]')["result"]
    if not result:
        sys.exit(f"render_dashboard: Prometheus at {base} has no offloop_step for run {run!r}")
    times = [float(t) for series in result for t, _ in series["values"]]
    return min(times), max(times)


def legend(template: str, labels: dict) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template).strip()


def fmt(value: float, unit: str | None) -> str:
    """A value as Grafana's units show it (bytes in binary steps, short in SI steps)."""
    if unit == "bytes":
        for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
            if abs(value) < 1024 or suffix == "TiB":
                return f"{value:.4g} {suffix}"
            value /= 1024
    if unit == "percentunit":
        return f"{100 * value:.3g}%"
    if unit == "s":
        return f"{value:.3g} s"
    for scale, suffix in ((1e9, " G"), (1e6, " M"), (1e3, " k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.4g}"


def panel_series(base: str, panel: dict, run: str, start: float, end: float, step: float,
                 rate_interval: float) -> list[tuple[str, list[tuple[float, float]]]]:
    """(legend, [(seconds into the run, value)]) for each series the panel's queries return."""
    series = []
    for target in panel["targets"]:
        expr = target["expr"].replace("$__rate_interval", f"{round(rate_interval * 1000)}ms")
        expr = expr.replace("$run", re.escape(run))
        for item in api(base, "query_range", query=expr, start=start, end=end, step=step)["result"]:
            points = [(float(t) - start, float(v)) for t, v in item["values"] if math.isfinite(float(v))]
            if points:
                series.append((legend(target.get("legendFormat", ""), item["metric"]), points))
    return series


def draw(base: str, run: str, dashboard: dict, out: Path, step: float, scrape_interval: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle
    from matplotlib.ticker import FuncFormatter

    start, end = run_span(base, run)
    rate_interval = max(4 * scrape_interval, step + scrape_interval)  # as Grafana picks it
    panels = dashboard["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    width, row_height, header = 16.0, 0.36, 0.5  # inches
    height = rows * row_height + header
    fig = plt.figure(figsize=(width, height), facecolor=BACKGROUND)
    fig.text(0.01, 1 - 0.3 / height, f"{dashboard['title']}: run {run}, {end - start:.1f} s scraped",
             color=TEXT, fontsize=13, va="center")

    def box(pos: dict, left: float = 0.0, right: float = 0.0, top: float = 0.0, bottom: float = 0.0):
        """A grid cell in figure coordinates, shrunk by margins given in inches."""
        x0 = pos["x"] / 24 * width + 0.04 + left
        x1 = (pos["x"] + pos["w"]) / 24 * width - 0.04 - right
        y1 = height - header - pos["y"] * row_height - 0.04 - top
        y0 = height - header - (pos["y"] + pos["h"]) * row_height + 0.04 + bottom
        return [x0 / width, y0 / height, (x1 - x0) / width, (y1 - y0) / height]

    for panel in panels:
        pos = panel["gridPos"]
        x, y, w, h = box(pos)
        fig.patches.append(Rectangle((x, y), w, h, transform=fig.transFigure, color=PANEL, zorder=-1))
        fig.text(x + 0.1 / width, y + h - 0.18 / height, panel["title"], color=TEXT, fontsize=10,
                 va="center", weight="bold")
        unit = panel["fieldConfig"]["defaults"].get("unit")
        series = panel_series(base, panel, run, start, end, step, rate_interval)
        if panel["type"] == "stat":
            text = fmt(series[0][1][-1][1], unit) if series else "No data"
            fig.text(x + w / 2, y + h * 0.42, text, color=COLORS[0] if series else GRID, fontsize=20,
                     ha="center", va="center", weight="bold")
            continue
        ax = fig.add_axes(box(pos, left=0.75, right=0.15, top=0.4, bottom=0.3))
        ax.set_facecolor(PANEL)
        for spine in ax.spines.values():
            spine.set_visible(False)
        if not series:
            ax.text(0.5, 0.5, "No data", color=GRID, ha="center", va="center", transform=ax.transAxes)
        for i, (name, points) in enumerate(series):
            ax.plot([p[0] for p in points], [p[1] for p in points], color=COLORS[i % len(COLORS)],
                    linewidth=1.4, label=name)
        ax.tick_params(colors=TEXT, labelsize=7, length=0)
        ax.grid(color=GRID, linewidth=0.5)
        ax.set_xlim(0, end - start)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _, unit=unit: fmt(v, unit)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g} s"))
        if series:
            ax.legend(loc="best", fontsize=7, facecolor=PANEL, edgecolor=GRID, labelcolor=TEXT,
                      ncol=min(2, len(series)), framealpha=0.85)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90, facecolor=BACKGROUND)
    print(f"render_dashboard: wrote {out} ({end - start:.1f}s of run {run})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus base URL")
    parser.add_argument("--run", default="demo", help="the run label to draw (default: demo)")
    parser.add_argument("--dashboard", type=Path, default=DASHBOARD)
    parser.add_argument("--out", type=Path, default=ROOT / "docs/img/dashboard.png")
    parser.add_argument("--step", type=float, default=1.0, help="seconds between points")
    parser.add_argument("--scrape-interval", type=float, default=2.0,
                        help="the job's scrape interval, in seconds, for $__rate_interval")
    args = parser.parse_args(argv)
    draw(args.prometheus, args.run, json.loads(args.dashboard.read_text()), args.out, args.step,
         args.scrape_interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
