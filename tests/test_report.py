"""Report and comparison outputs: files exist, PNGs decode, tables carry the numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from matplotlib.image import imread

from scheduling.simulator.compare import write_comparison
from scheduling.simulator.metrics import ClusterInfo, Summary, TeamInfo, summarize
from scheduling.simulator.report import cdf_points, fmt_metric, human_duration, write_report

CLUSTER = ClusterInfo({"n1": 4, "n2": 4})
TEAMS = [TeamInfo("vision", 4), TeamInfo("speech", 4)]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(policy: str, x_admit: float) -> Summary:
    """Job x (4 GPUs, vision) admitted at ``x_admit``; job y (2 GPUs, speech) at once."""
    events: list[dict[str, Any]] = [
        {"t": 0, "type": "submit", "job": "x", "team": "vision", "gpus": 4, "duration": 100},
        {"t": 0, "type": "submit", "job": "y", "team": "speech", "gpus": 2, "duration": 50},
        {"t": 0, "type": "admit", "job": "y", "team": "speech",
         "placement": [{"node": "n2", "gpus": [0, 1]}], "slowdown": 1.0},
        {"t": x_admit, "type": "admit", "job": "x", "team": "vision",
         "placement": [{"node": "n1", "gpus": [0, 1, 2, 3]}], "slowdown": 1.0},
        {"t": 50, "type": "finish", "job": "y", "team": "speech"},
        {"t": x_admit + 100, "type": "finish", "job": "x", "team": "vision"},
    ]  # fmt: skip
    events.sort(key=lambda e: e["t"])
    return summarize(events, CLUSTER, TEAMS, policy=policy, wall_s=0.5)


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 300
    assert image.std() > 0  # something was drawn


def test_write_report_writes_json_markdown_and_plots(tmp_path: Path) -> None:
    summary = run("fast", 0)
    out = tmp_path / "report"
    write_report(out, summary, title="Tiny trace")
    assert json.loads((out / "summary.json").read_text()) == summary.as_dict()
    for name in ("queue_and_utilization.png", "jct_cdf.png", "team_usage.png"):
        assert_png(out / name)
    md = (out / "report.md").read_text()
    assert md.startswith("# Tiny trace\n")
    # makespan 100 s; utilisation (4*100 + 2*50) / (8*100); fragmentation: n2 has 2 free
    # GPUs while partly used for 50 s, out of 100 + 200 idle GPU-seconds.
    assert "| Avg JCT (s) | 75.0 |" in md
    assert "| GPU utilisation, holds included (0-1) | 0.625 |" in md
    assert "| Fragmentation (0-1) | 0.3333 |" in md
    assert "| Small jobs (<= 8 GPUs) placed on one node (0-1) | 1.0 |" in md
    assert "| Jain fairness over teams (0-1) | 1.0 |" in md
    assert "| Goodput, work that counted toward finishing (0-1) | 0.625 |" in md
    # team rows: nominal, jobs, finished, rejected, JCT, first wait avg/p99, total wait avg/p99,
    # GPU-h, avg GPUs, share of nominal, nominal deficit, preempted
    waits = "0.0 | 0.0 | 0.0 | 0.0"
    assert f"| vision | 4.0 | 1 | 1 | 0 | 100.0 | {waits} | 0.1111 | 4.0 | 1.0 | 0.0 | 0 |" in md
    assert f"| speech | 4.0 | 1 | 1 | 0 | 50.0 | {waits} | 0.0278 | 1.0 | 0.25 | 0.0 | 0 |" in md
    for name in ("queue_and_utilization.png", "jct_cdf.png", "team_usage.png"):
        assert f"]({name})" in md


def test_report_of_an_empty_log_still_renders(tmp_path: Path) -> None:
    summary = summarize([], CLUSTER, TEAMS, policy="idle", wall_s=0)
    write_report(tmp_path, summary, title="Nothing ran")
    for name in ("queue_and_utilization.png", "jct_cdf.png", "team_usage.png"):
        assert_png(tmp_path / name)
    assert "| Avg JCT (s) | - |" in (tmp_path / "report.md").read_text()


def test_write_comparison_tables_and_ratios(tmp_path: Path) -> None:
    fast, slow = run("fast", 0), run("slow", 20)
    write_comparison(tmp_path, [fast, slow])
    assert_png(tmp_path / "compare.png")
    table = json.loads((tmp_path / "compare.json").read_text())
    assert table["baseline"] == "fast"
    assert table["policies"] == ["fast", "slow"]
    metrics, ratios = table["metrics"], table["ratio_to_baseline"]
    assert metrics["avg_jct_s"] == {"fast": 75.0, "slow": 85.0}
    assert metrics["avg_first_wait_s"] == {"fast": 0.0, "slow": 10.0}
    assert metrics["avg_total_wait_s"] == {"fast": 0.0, "slow": 10.0}
    # slow: 500 GPU-s over 8 x 120; idle 460 GPU-s, of which 100 on the half-used n2
    assert metrics["gpu_utilization"] == {"fast": 0.625, "slow": round(500 / 960, 4)}
    assert metrics["fragmentation"] == {"fast": 0.3333, "slow": round(100 / 460, 4)}
    assert ratios["avg_jct_s"] == {"slow": round(85 / 75, 3)}
    assert ratios["avg_first_wait_s"] == {"slow": None}  # baseline 0: no ratio
    assert ratios["gpu_utilization"] == {"slow": round(0.5208 / 0.625, 3)}
    assert [s["policy"] for s in table["summaries"]] == ["fast", "slow"]
    md = (tmp_path / "compare.md").read_text()
    assert "| Metric | `fast` | `slow` |" in md
    assert "| Avg JCT (s) | 75.0 | 85.0 [×1.13] |" in md
    assert "| Avg first wait, submit to first admit (s) | 0.0 | 10.0 |" in md
    assert "| Makespan (s) | 100.0 | 120.0 (2.0 min) [×1.20] |" in md
    assert "![Policy comparison](compare.png)" in md


@pytest.mark.parametrize("names", [[], ["a", "a"]])
def test_write_comparison_needs_distinct_runs(tmp_path: Path, names: list[str]) -> None:
    with pytest.raises(ValueError):
        write_comparison(tmp_path, [run(name, 0) for name in names])


def test_cdf_points_downsample_but_keep_the_ends() -> None:
    samples = np.sort(np.random.default_rng(0).exponential(100, 10_000))
    x, y = cdf_points(samples, max_points=500)
    assert x.size <= 500
    assert x[0] == samples[0] and x[-1] == samples[-1] and y[-1] == 1.0
    assert np.all(np.diff(x) >= 0) and np.all(np.diff(y) > 0)
    np.testing.assert_allclose(cdf_points(np.array([1.0, 2.0]))[1], [0.5, 1.0])


def test_durations_are_humanised_in_tables() -> None:
    assert human_duration(90) == ""
    assert human_duration(600) == "10.0 min"
    assert human_duration(3 * 3600) == "3.0 h"
    assert human_duration(10 * 86400) == "10.0 d"
    assert fmt_metric("avg_jct_s", 12345.678) == "12,345.678 (3.4 h)"
    assert fmt_metric("gpu_utilization", 0.5) == "0.5"
    assert fmt_metric("p99_jct_s", None) == "-"
