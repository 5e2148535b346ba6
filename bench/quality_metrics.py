"""What the quality benchmark compares (`bench/quality.py`): its metrics, how a policy's value
is compared with the baseline's, and the spread of the comparisons over many cases."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

BIG_JOB_GPUS = 16


@dataclass(frozen=True)
class Metric:
    """A summary key, how it is compared with the baseline, and which way is better."""

    key: str
    label: str
    compare: str  # "ratio" (policy / baseline) or "difference" (policy - baseline)
    lower_is_better: bool
    optional: bool = False  # skipped, not failed, when the summaries lack it


METRICS: tuple[Metric, ...] = (
    Metric("avg_jct_s", "avg JCT", "ratio", True),
    Metric("p99_first_wait_big_s", f"p99 first wait, jobs >= {BIG_JOB_GPUS} GPUs", "ratio", True),
    Metric("jain_fairness", "Jain fairness over teams", "difference", False),
    Metric("preemptions", "preemptions", "ratio", True),
    Metric("partial_gang_jobs", "jobs that held a partial gang", "ratio", True),
    Metric("goodput", "goodput", "ratio", False, optional=True),
    Metric("nominal_deficit_gpu_hours", "nominal deficit (GPU-h)", "ratio", True, optional=True),
    Metric("avg_total_wait_s", "avg total wait", "ratio", True, optional=True),
    Metric("avg_jct_big_s", f"avg JCT, jobs >= {BIG_JOB_GPUS} GPUs", "ratio", True, optional=True),
    Metric(
        "p99_total_wait_big_s",
        f"p99 total wait, jobs >= {BIG_JOB_GPUS} GPUs",
        "ratio",
        True,
        optional=True,
    ),
)


def compare(metric: Metric, value: Any, base: Any) -> tuple[float | None, bool | None]:
    """(ratio or difference to the baseline, no worse than it?); (None, None) if a value is
    missing. A ratio over a baseline of 0 is 1 when both are 0, else undefined (None), but the
    'no worse' verdict still holds."""
    if not isinstance(value, int | float) or not isinstance(base, int | float):
        return None, None
    tolerance = 1e-9 * max(abs(base), 1.0)
    no_worse = value <= base + tolerance if metric.lower_is_better else value >= base - tolerance
    if metric.compare == "difference":
        return round(value - base, 4), no_worse
    if base == 0:
        return (1.0 if value == 0 else None), no_worse
    return round(value / base, 4), no_worse


def spread(metric: Metric, values: list[float]) -> dict[str, Any]:
    """Median, p10, p90, min, max and the geometric mean (ratios) or mean (differences)."""
    if not values:
        return {"n": 0}
    x = np.asarray(values, dtype=float)
    out: dict[str, Any] = {
        "n": int(x.size),
        "median": round(float(np.median(x)), 4),
        "p10": round(float(np.percentile(x, 10)), 4),
        "p90": round(float(np.percentile(x, 90)), 4),
        "min": round(float(x.min()), 4),
        "max": round(float(x.max()), 4),
    }
    if metric.compare == "ratio":
        positive = x[x > 0]
        geo = float(np.exp(np.log(positive).mean())) if positive.size else None
        out["geomean"] = None if geo is None else round(geo, 4)
        out["zeros"] = int(x.size - positive.size)  # a zero ratio has no logarithm
    else:
        out["mean"] = round(float(x.mean()), 4)
    return out


def summarize_cases(cases: list[dict[str, Any]], policies: list[str], baseline: str) -> dict:
    """Per metric and policy over the given cases: spread of the comparisons, win fraction;
    per policy the geometric mean (and median) of avg JCT over the oracle's."""
    per_metric: dict[str, dict[str, Any]] = {}
    others = [p for p in policies if p != baseline]
    for m in METRICS:
        row = {}
        for policy in others:
            pairs = [
                c["versus_baseline"][policy][m.key]
                for c in cases
                if m.key in c["versus_baseline"].get(policy, {})
            ]
            verdicts = [v["no_worse"] for v in pairs if v["no_worse"] is not None]
            values = [v["value"] for v in pairs if v["value"] is not None]
            if not verdicts:
                continue
            row[policy] = {
                **spread(m, values),
                "cases": len(verdicts),
                "no_worse": sum(verdicts),
                "no_worse_fraction": round(sum(verdicts) / len(verdicts), 4),
            }
        if row:
            per_metric[m.key] = row
    oracle = {}
    for policy in policies:
        x = np.array(
            [c["jct_over_oracle"][policy] for c in cases if policy in c["jct_over_oracle"]]
        )
        if x.size:
            oracle[policy] = {
                "n": int(x.size),
                "geomean": round(float(np.exp(np.log(x).mean())), 4),
                "median": round(float(np.median(x)), 4),
                "min": round(float(x.min()), 4),
                "max": round(float(x.max()), 4),
            }
    return {"cases": len(cases), "metrics": per_metric, "jct_over_oracle": oracle}
