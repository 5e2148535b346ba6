"""Write one simulation run's ``summary.json``, ``report.md`` and PNG plots.

The report is built from a :class:`~scheduling.simulator.metrics.Summary` only, so it can
be regenerated from a saved event log. Figures use matplotlib's ``Figure`` directly (Agg
rendering, no pyplot global state), which keeps this safe to call from tests and threads.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from scheduling.simulator.metrics import Summary

PLOTS = {
    "queue_and_utilization.png": "Queue length and GPU allocation over time",
    "jct_cdf.png": "CDF of job completion time, first wait and total wait",
    "team_usage.png": "GPU usage per team",
}

# (summary key, label); seconds keys end in "_s" and also get a human-readable duration.
SUMMARY_ROWS: tuple[tuple[str, str], ...] = (
    ("jobs", "Jobs submitted"),
    ("finished", "Finished"),
    ("rejected", "Rejected"),
    ("timed_out", "Stopped at their time limit"),
    ("unfinished", "Unfinished at end"),
    ("preemptions", "Preemptions"),
    ("evictions", "Evictions (gang timeouts)"),
    ("avg_jct_s", "Avg JCT (s)"),
    ("p50_jct_s", "p50 JCT (s)"),
    ("p99_jct_s", "p99 JCT (s)"),
    ("avg_first_wait_s", "Avg first wait, submit to first admit (s)"),
    ("p50_first_wait_s", "p50 first wait (s)"),
    ("p99_first_wait_s", "p99 first wait (s)"),
    ("avg_total_wait_s", "Avg total wait, every wait of a job (s)"),
    ("p50_total_wait_s", "p50 total wait (s)"),
    ("p99_total_wait_s", "p99 total wait (s)"),
    ("makespan_s", "Makespan (s)"),
    ("gpu_utilization", "GPU utilisation, holds included (0-1)"),
    ("gpu_busy", "GPU busy, admitted jobs only (0-1)"),
    ("goodput", "Goodput, work that counted toward finishing (0-1)"),
    ("gpu_hours_lost_to_preemption", "GPU-hours lost to preemption (redone work + restarts)"),
    ("gpu_hours_lost_to_time_limits", "GPU-hours of runs stopped at their time limit"),
    ("fragmentation", "Fragmentation (0-1)"),
    ("jain_fairness", "Jain fairness over teams (0-1)"),
    ("partial_gang_jobs", "Gangs that held some but not all replicas"),
    ("partial_gang_idle_gpu_hours", "GPU-hours bound idle by partial gangs"),
    ("nominal_deficit_gpu_hours", "Nominal deficit, all teams (GPU-hours)"),
    ("single_node_share_small", "Small jobs (<= 8 GPUs) placed on one node (0-1)"),
    ("avg_slowdown", "Avg placement slowdown (x)"),
    ("wall_s", "Simulation wall time (s)"),
)

TEAM_COLUMNS: tuple[tuple[str, str], ...] = (
    ("team", "Team"),
    ("nominal_gpus", "Nominal GPUs"),
    ("jobs", "Jobs"),
    ("finished", "Finished"),
    ("rejected", "Rejected"),
    ("avg_jct_s", "Avg JCT (s)"),
    ("avg_first_wait_s", "Avg first wait (s)"),
    ("p99_first_wait_s", "p99 first wait (s)"),
    ("avg_total_wait_s", "Avg total wait (s)"),
    ("p99_total_wait_s", "p99 total wait (s)"),
    ("gpu_hours", "GPU-hours"),
    ("avg_gpus", "Avg GPUs"),
    ("avg_share_of_nominal", "Avg / nominal"),
    ("nominal_deficit_gpu_hours", "Nominal deficit (GPU-h)"),
    ("preempted", "Preempted"),
)

COHORT_COLUMNS: tuple[tuple[str, str], ...] = (
    ("cohort", "Cohort"),
    ("teams", "Teams"),
    ("nominal_gpus", "Teams' nominal GPUs"),
    ("jobs", "Jobs"),
    ("finished", "Finished"),
    ("avg_jct_s", "Avg JCT (s)"),
    ("gpu_hours", "GPU-hours"),
    ("avg_gpus", "Avg GPUs"),
    ("nominal_deficit_gpu_hours", "Nominal deficit (GPU-h)"),
)

DEFINITIONS = """\
- **JCT**: finish time minus submit time, finished jobs only. **First wait**: first admission
  minus submit time, admitted jobs only. **Total wait**: every wait of a finished job summed
  (submit to first admission, and each preemption or eviction to the next admission).
- **GPU utilisation**: allocated GPU-seconds (shares count fractionally, partial-gang holds
  included) over total GPUs x makespan. **GPU busy**: the same without holds. **Goodput**:
  duration x GPUs of the finished jobs (work at the best placement, counted once) over total
  GPUs x makespan. **Lost to preemption**: GPU-time of preempted runs that no checkpoint
  kept, plus the restart time paid after each preemption.
- **Fragmentation**: of all idle GPU-time, the share on nodes that are partly in use
  (idle GPUs there cannot serve a whole-node replica).
- **Jain fairness**: Jain's index over teams of the mean duration / JCT of their finished jobs
  (1 = every team's jobs are slowed down equally).
- **Partial gangs**: jobs of several replicas that had some but not all bound; their idle
  GPU-hours are the GPUs bound while the rest waited.
- **Nominal deficit**: GPU-hours a team sat below its nominal GPUs while it had pending jobs
  that fitted in the gap and other teams used GPUs above their own nominal: at each instant
  min(nominal - used, GPUs of its pending jobs that each fit in nominal - used, GPUs the other
  teams use above nominal), when positive.
"""


# A cluster of several GPU models: a row per model (docs/decisions/0022).
MODEL_COLUMNS = [
    ("model", "GPU model"),
    ("gpus", "GPUs"),
    ("gpu_hours", "GPU-hours used"),
    ("busy", "Busy share"),
    ("jobs_admitted", "Jobs first admitted on it"),
    ("avg_first_wait_s", "Their avg first wait (s)"),
]
TEAM_MODEL_COLUMNS = [
    ("team", "Team"),
    ("model", "GPU model"),
    ("gpu_hours", "GPU-hours used"),
    ("jobs_admitted", "Jobs first admitted on it"),
    ("avg_first_wait_s", "Their avg first wait (s)"),
]


def write_report(out_dir: Path, summary: Summary, *, title: str) -> None:
    """Write ``summary.json``, ``report.md`` and the three plots into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = summary.as_dict()
    (out_dir / "summary.json").write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")
    _plot_queue_and_utilization(out_dir / "queue_and_utilization.png", summary, title)
    _plot_cdfs(out_dir / "jct_cdf.png", summary, title)
    _plot_team_usage(out_dir / "team_usage.png", summary, title)
    (out_dir / "report.md").write_text(render_markdown(data, title=title))


def render_markdown(data: dict[str, Any], *, title: str) -> str:
    """The markdown report for a summary dict (as written to ``summary.json``)."""
    lines = [
        f"# {title}",
        "",
        f"Policy `{data['policy']}`: {fmt_value(data['jobs'])} jobs on "
        f"{fmt_value(data.get('total_gpus'))} GPUs over "
        f"{human_duration(data['makespan_s']) or fmt_value(data['makespan_s']) + ' s'}.",
        "",
        "## Summary",
        "",
        "| Metric | Value |",
        "| --- | ---: |",
    ]
    lines += [f"| {label} | {fmt_metric(key, data.get(key))} |" for key, label in SUMMARY_ROWS]
    lines += ["", "## Teams", ""]
    lines += markdown_table(
        [label for _, label in TEAM_COLUMNS],
        [[fmt_value(row.get(key)) for key, _ in TEAM_COLUMNS] for row in data["teams"]],
    )
    if data.get("cohorts"):
        lines += ["", "## Cohorts (the organization tree; each its teams' rows summed)", ""]
        lines += markdown_table(
            [label for _, label in COHORT_COLUMNS],
            [[fmt_value(row.get(key)) for key, _ in COHORT_COLUMNS] for row in data["cohorts"]],
        )
    if data.get("models"):
        lines += ["", "## GPU models", ""]
        lines += markdown_table(
            [label for _, label in MODEL_COLUMNS],
            [[fmt_value(row.get(key)) for key, _ in MODEL_COLUMNS] for row in data["models"]],
        )
    if data.get("team_models"):
        lines += ["", "## GPU models by team", ""]
        lines += markdown_table(
            [label for _, label in TEAM_MODEL_COLUMNS],
            [
                [fmt_value(row.get(key)) for key, _ in TEAM_MODEL_COLUMNS]
                for row in data["team_models"]
            ],
        )
    lines += ["", "## Plots", ""]
    for name, caption in PLOTS.items():
        lines += [f"### {caption}", "", f"![{caption}]({name})", ""]
    lines += ["## Definitions", "", DEFINITIONS]
    return "\n".join(lines)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A markdown table: first column left-aligned, the others right-aligned."""
    align = ["---"] + ["---:"] * (len(header) - 1)
    return [
        "| " + " | ".join(header) + " |",
        "| " + " | ".join(align) + " |",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def fmt_value(value: Any) -> str:
    """A summary value as shown in tables: thousands separators, ``-`` for missing."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    return f"{value:,}"


def fmt_metric(key: str, value: Any) -> str:
    """Like :func:`fmt_value`, adding a readable duration after large seconds values."""
    text = fmt_value(value)
    human = human_duration(value) if key.endswith("_s") and value is not None else ""
    return f"{text} ({human})" if human else text


def human_duration(seconds: float) -> str:
    """``'3.4 h'`` style text for durations of two minutes or more, else ``''``."""
    for limit, unit, scale in ((2 * 86400, "d", 86400), (7200, "h", 3600), (120, "min", 60)):
        if seconds >= limit:
            return f"{seconds / scale:,.1f} {unit}"
    return ""


def duration_unit(max_seconds: float) -> tuple[float, str]:
    """A (divisor, unit name) that keeps an axis of durations up to ``max_seconds`` readable."""
    if max_seconds >= 2 * 86400:
        return 86400.0, "days"
    if max_seconds >= 7200:
        return 3600.0, "hours"
    if max_seconds >= 120:
        return 60.0, "minutes"
    return 1.0, "seconds"


def cdf_points(samples: np.ndarray, max_points: int = 2000) -> tuple[np.ndarray, np.ndarray]:
    """Empirical CDF of sorted ``samples`` as at most ``max_points`` (x, fraction) pairs."""
    n = samples.size
    if n == 0:
        return np.zeros(0), np.zeros(0)
    idx = np.unique(np.linspace(0, n - 1, min(n, max_points)).round().astype(np.int64))
    return samples[idx], (idx + 1) / n


def plot_cdf(
    ax: Axes, samples: np.ndarray, label: str, *, floor_s: float = 1.0, color: Any = None
) -> None:
    """Step CDF on a log-x axis; values below ``floor_s`` (log(0)) are drawn at the floor."""
    x, y = cdf_points(samples)
    if x.size:
        ax.step(np.maximum(x, floor_s), y, where="post", label=label, color=color)
    ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.set_ylabel("fraction of jobs")
    ax.grid(True, which="major", alpha=0.3)


def _no_data(ax: Axes) -> None:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def _plot_queue_and_utilization(path: Path, summary: Summary, title: str) -> None:
    s, data = summary.series, summary.data
    scale, unit = duration_unit(float(data["makespan_s"] or 0))
    fig = Figure(figsize=(11, 7), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    fig.suptitle(f"{title}: queue and GPU allocation ({data['policy']})")
    if s.t_s.size:
        top.plot(s.t_s / scale, s.queue_len, color="tab:purple", label="queued jobs")
        bottom.plot(s.t_s / scale, s.allocated_gpus, label="allocated (incl. partial-gang holds)")
        bottom.plot(s.t_s / scale, s.busy_gpus, label="busy (admitted jobs)")
        bottom.axhline(s.total_gpus, color="black", ls="--", lw=1, label="cluster GPUs")
        top.legend(loc="upper right")
        bottom.legend(loc="lower right")
    else:
        _no_data(top)
        _no_data(bottom)
    top.set_title("Queue length (waiting or requeued jobs, mean per time bucket)")
    top.set_ylabel("jobs")
    bottom.set_title(
        f"GPUs allocated: utilisation {fmt_value(data['gpu_utilization'])}, "
        f"busy {fmt_value(data['gpu_busy'])}, fragmentation {fmt_value(data['fragmentation'])}"
    )
    bottom.set_ylabel("GPUs")
    bottom.set_ylim(0, max(s.total_gpus, 1) * 1.05)
    bottom.set_xlabel(f"time since first event ({unit})")
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    fig.savefig(path, dpi=110)


def _plot_cdfs(path: Path, summary: Summary, title: str) -> None:
    s, data = summary.series, summary.data
    fig = Figure(figsize=(9, 5.5), layout="constrained")
    ax = fig.subplots()
    plot_cdf(ax, s.jct_s, f"JCT (n={s.jct_s.size:,}, p50 {fmt_value(data['p50_jct_s'])} s)")
    plot_cdf(
        ax,
        s.first_wait_s,
        f"first wait (n={s.first_wait_s.size:,}, p50 {fmt_value(data['p50_first_wait_s'])} s)",
    )
    plot_cdf(
        ax,
        s.total_wait_s,
        f"total wait (n={s.total_wait_s.size:,}, p50 {fmt_value(data['p50_total_wait_s'])} s)",
    )
    if s.jct_s.size or s.first_wait_s.size or s.total_wait_s.size:
        ax.legend(loc="lower right")
    else:
        _no_data(ax)
    ax.set_title(f"{title}: CDF of JCT and waits ({data['policy']})")
    ax.set_xlabel("seconds (log scale; waits under 1 s drawn at 1 s)")
    fig.savefig(path, dpi=110)


def _plot_team_usage(path: Path, summary: Summary, title: str) -> None:
    s, rows = summary.series, summary.data["teams"]
    names = [row["team"] for row in rows]
    colors = [colormaps["tab20"](i % 20) for i in range(len(names))]
    fig = Figure(figsize=(11, 8), layout="constrained")
    bars, usage = fig.subplots(2, 1)
    fig.suptitle(f"{title}: GPU usage per team ({summary.policy})")
    x = np.arange(len(names))
    bars.bar(x - 0.2, [row["avg_gpus"] for row in rows], 0.4, color=colors, label="avg GPUs used")
    bars.bar(
        x + 0.2,
        [row["nominal_gpus"] for row in rows],
        0.4,
        color="white",
        edgecolor="black",
        hatch="//",
        label="nominal GPUs",
    )
    bars.set_xticks(x, names, rotation=30 if len(names) > 8 else 0, ha="right")
    bars.set_ylabel("GPUs")
    top = max(
        [1.0] + [float(r["avg_gpus"]) for r in rows] + [float(r["nominal_gpus"]) for r in rows]
    )
    bars.set_ylim(0, top * 1.25)
    bars.set_title("Average GPUs used over the run vs nominal quota")
    bars.legend(loc="upper right")
    scale, unit = duration_unit(float(summary.data["makespan_s"] or 0))
    if s.t_s.size and names:
        usage.stackplot(
            s.t_s / scale, [s.team_gpus[n] for n in names], labels=names, colors=colors, alpha=0.85
        )
        usage.axhline(s.total_gpus, color="black", ls="--", lw=1, label="cluster GPUs")
        usage.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    else:
        _no_data(usage)
    usage.set_title("GPUs allocated per team over time (stacked, holds included)")
    usage.set_xlabel(f"time since first event ({unit})")
    usage.set_ylabel("GPUs")
    for ax in (bars, usage):
        ax.grid(True, axis="y", alpha=0.3)
    fig.savefig(path, dpi=110)
