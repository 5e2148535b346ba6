"""Side-by-side comparison of several policies' runs of the same trace.

Writes ``compare.md`` (one table, a column per policy, ratios to the first policy),
``compare.json`` (the same numbers plus every full summary) and ``compare.png`` (bar
charts of the headline metrics and the JCT CDFs overlaid). The first run is the baseline.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure

from scheduling.simulator.metrics import Summary
from scheduling.simulator.report import (
    SUMMARY_ROWS,
    duration_unit,
    fmt_metric,
    markdown_table,
    plot_cdf,
)

# (key, title, y label); a None label means seconds, shown in a readable unit.
BARS: tuple[tuple[str, str, str | None], ...] = (
    ("avg_jct_s", "Avg JCT", None),
    ("avg_first_wait_s", "Avg first wait", None),
    ("avg_total_wait_s", "Avg total wait", None),
    ("gpu_utilization", "GPU utilisation (holds included)", "share of GPU-time allocated"),
    ("goodput", "Goodput", "share of GPU-time doing work that counted"),
    ("fragmentation", "Fragmentation", "share of idle GPU-time on partly used nodes"),
)


def write_comparison(out_dir: Path, runs: Sequence[Summary]) -> None:
    """Write ``compare.md``, ``compare.json`` and ``compare.png`` for ``runs`` into ``out_dir``.

    Raises ``ValueError`` when ``runs`` is empty or two runs share a policy name (the
    policy names the columns).
    """
    if not runs:
        raise ValueError("nothing to compare: no runs given")
    policies = [run.policy for run in runs]
    if len(set(policies)) != len(policies):
        raise ValueError(f"policy names must be unique to compare runs, got {policies}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = comparison_table(runs)
    (out_dir / "compare.json").write_text(json.dumps(table, indent=2, allow_nan=False) + "\n")
    (out_dir / "compare.md").write_text(_markdown(table))
    _plot(out_dir / "compare.png", runs)


def ratio(value: Any, base: Any) -> float | None:
    """``value / base`` rounded to 3 decimals; None when either is missing or base is 0."""
    if not isinstance(value, int | float) or not isinstance(base, int | float) or base == 0:
        return None
    return round(value / base, 3)


def comparison_table(runs: Sequence[Summary]) -> dict[str, Any]:
    """The numbers behind ``compare.json``: metric -> policy -> value, and ratios to run 0."""
    data = [run.as_dict() for run in runs]
    base = data[0]
    return {
        "baseline": base["policy"],
        "policies": [d["policy"] for d in data],
        "metrics": {key: {d["policy"]: d.get(key) for d in data} for key, _ in SUMMARY_ROWS},
        "ratio_to_baseline": {
            key: {d["policy"]: ratio(d.get(key), base.get(key)) for d in data[1:]}
            for key, _ in SUMMARY_ROWS
        },
        "summaries": data,
    }


def _markdown(table: dict[str, Any]) -> str:
    policies, base = table["policies"], table["baseline"]
    header = ["Metric", *(f"`{p}`" for p in policies)]
    rows = []
    for key, label in SUMMARY_ROWS:
        cells = [label]
        for policy in policies:
            text = fmt_metric(key, table["metrics"][key][policy])
            r = table["ratio_to_baseline"][key].get(policy)
            cells.append(f"{text} [×{r:.2f}]" if r is not None else text)
        rows.append(cells)
    lines = [
        "# Policy comparison",
        "",
        f"Each column is one policy on the same trace; `[×r]` is the ratio to `{base}`.",
        "",
        *markdown_table(header, rows),
        "",
        "![Policy comparison](compare.png)",
        "",
    ]
    return "\n".join(lines)


def _plot(path: Path, runs: Sequence[Summary]) -> None:
    data = [run.as_dict() for run in runs]
    names = [d["policy"] for d in data]
    colors = [colormaps["tab10"](i % 10) for i in range(len(names))]
    fig = Figure(figsize=(15, 9), layout="constrained")
    grid = fig.add_gridspec(2, len(BARS))
    fig.suptitle(f"Policy comparison (baseline: {names[0]})")
    x = np.arange(len(names))
    for i, (key, title, ylabel) in enumerate(BARS):
        ax = fig.add_subplot(grid[0, i])
        values = [float(d.get(key) or 0.0) for d in data]
        scale, unit = duration_unit(max(values)) if ylabel is None else (1.0, ylabel)
        heights = [v / scale for v in values]
        drawn = ax.bar(x, heights, color=colors)
        ax.bar_label(drawn, labels=[f"{h:,.3g}" for h in heights], fontsize="small")
        ax.set_xticks(x, names, rotation=30 if len(names) > 3 else 0, ha="right")
        ax.set_title(title)
        ax.set_ylabel(unit)
        if ylabel is not None:
            ax.set_ylim(0, 1.05)
        ax.grid(True, axis="y", alpha=0.3)
    cdf = fig.add_subplot(grid[1, :])
    for run, color in zip(runs, colors, strict=True):
        plot_cdf(cdf, run.series.jct_s, f"{run.policy} (n={run.series.jct_s.size:,})", color=color)
    cdf.set_title("CDF of job completion time")
    cdf.set_xlabel("JCT, seconds (log scale)")
    if any(run.series.jct_s.size for run in runs):
        cdf.legend(loc="lower right")
    fig.savefig(path, dpi=110)
