"""The quality benchmark's report: quality.md, quality.png and the console table.

`bench/quality.py` runs the cases and builds the report (the dict it writes as quality.json);
this module only renders it. The figures, the metrics and their order (`report["metrics"]`),
the baseline and the big-job threshold (`report["config"]`) all come from that dict, so a saved
quality.json renders the same as the run that wrote it. The runner imports this module, and
`CANDIDATE` and `ORACLE` from it, so this module never imports the runner (no cycle).

    .venv/bin/python -m bench.quality_report bench/results/quality.json [...]

renders a saved report again (its .md and .png beside it), with what this module shows now.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FormatStrFormatter
from rich.table import Table

CANDIDATE = "berth"  # the policy the case tables, the losses and the plot single out
ORACLE = "oracle"  # the SRTF oracle's key among each case's results


def _fmt(value: Any, digits: int = 3, signed: bool = False) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def _metric_rows(
    metrics: Sequence[dict[str, Any]], summary: dict[str, Any], baseline: str
) -> list[list[str]]:
    rows = []
    for m in metrics:
        for policy, s in summary["metrics"].get(m["key"], {}).items():
            diff = m["compare"] == "difference"
            digits = 4 if diff else 3
            if diff:
                center = f"mean {_fmt(s.get('mean'), digits, signed=True)}"
            else:
                zeros = s.get("zeros", 0)
                center = _fmt(s.get("geomean")) + (f" ({zeros} zeros left out)" if zeros else "")
            # A ratio over a baseline of 0 is undefined; the verdict still counts the case.
            counted = f"{s['cases']}" if s["n"] == s["cases"] else f"{s['n']} of {s['cases']}"
            rows.append(
                [
                    m["label"],
                    f"{policy} {'-' if diff else '/'} {baseline}",
                    counted,
                    _fmt(s.get("median"), digits, signed=diff),
                    f"{_fmt(s.get('p10'), digits, signed=diff)} .. "
                    f"{_fmt(s.get('p90'), digits, signed=diff)}",
                    f"{_fmt(s.get('min'), digits, signed=diff)} .. "
                    f"{_fmt(s.get('max'), digits, signed=diff)}",
                    center,
                    f"{s['no_worse']}/{s['cases']} ({100 * s['no_worse_fraction']:.0f} %)",
                ]
            )
    return rows


METRIC_HEADER = [
    "metric",
    "comparison",
    "cases (with a ratio)",
    "median",
    "p10 .. p90",
    "min .. max",
    "geo-mean",
    "no worse than baseline",
]


def held_out_table(report: dict[str, Any], which: str = "held_out") -> Table:
    """The held-out summary (or, `which` = "tuning", the tuning one) as a rich table."""
    held = report[which]
    title = "Held-out" if which == "held_out" else "Tuning"
    t = Table(
        title=f"{title} cases ({held['cases']}): each policy against {report['config']['baseline']}"
    )
    for col in METRIC_HEADER:
        t.add_column(col, justify="left" if col in ("metric", "comparison") else "right")
    for row in _metric_rows(report["metrics"], held, report["config"]["baseline"]):
        t.add_row(*row)
    for policy, s in held["jct_over_oracle"].items():
        t.add_row(
            "avg JCT / SRTF oracle",
            policy,
            f"{s['n']}",
            _fmt(s["median"]),
            "",
            f"{_fmt(s['min'])} .. {_fmt(s['max'])}",
            _fmt(s["geomean"]),
            "",
        )
    return t


def _md_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def _case_rows(records: list[dict[str, Any]], baseline: str) -> list[list[str]]:
    rows = []
    for r in records:
        v = r["versus_baseline"].get(CANDIDATE, {})
        res = r["results"]
        load = (r.get("offered_load") or {}).get("dominant")
        rows.append(
            [
                r["name"],
                _fmt(load, 2),
                _fmt(res[baseline].get("avg_jct_s"), 0),
                _fmt(res.get(CANDIDATE, {}).get("avg_jct_s"), 0),
                _fmt(res[ORACLE].get("avg_jct_s"), 0),
                _fmt(v.get("avg_jct_s", {}).get("value")),
                _fmt(v.get("p99_first_wait_big_s", {}).get("value")),
                _fmt(v.get("jain_fairness", {}).get("value"), 4, signed=True),
                f"{_fmt(res.get(CANDIDATE, {}).get('preemptions'))} / "
                f"{_fmt(res[baseline].get('preemptions'))}",
                _fmt(r["jct_over_oracle"].get(CANDIDATE)),
                _fmt(r["jct_over_oracle"].get(baseline)),
            ]
        )
    return rows


def _checkpoint_flag(cfg: dict[str, Any]) -> str:
    every = cfg.get("checkpoint_s")
    return "" if every is None else f" --checkpoint-s {every:g}"


def _checkpoints(cfg: dict[str, Any]) -> str:
    every = cfg.get("checkpoint_s")  # absent in reports written before the option
    if every is None:
        return "Preempted work is lost (no checkpoints; `--checkpoint-s` sets them)."
    return f"Every job checkpoints every {every:g} s: a preempted job resumes from its last one."


PHILLY_ALL = "philly, every size"  # the Philly windows together: the held-out windows


def oracle_by_group(cases: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Per group of cases (a Philly cluster size, a family), and for the Philly windows of
    every size together, each policy's geometric mean of avg JCT / the oracle's, and how many
    cases: the header and rows of a table. A geo-mean over every case mixes workloads whose
    distance to the oracle differs by an order of magnitude; this tells them apart."""
    policies = list(dict.fromkeys(p for c in cases for p in c["jct_over_oracle"]))
    groups: dict[str, list[dict[str, Any]]] = {}
    for c in cases:
        groups.setdefault(c["group"], []).append(c)
    philly = [c for c in cases if c["group"].startswith("philly")]
    if philly:
        groups[PHILLY_ALL] = philly
    rows = []
    for name, members in groups.items():
        cells = []
        for p in policies:
            x = np.array([c["jct_over_oracle"][p] for c in members if p in c["jct_over_oracle"]])
            cells.append(_fmt(float(np.exp(np.log(x).mean()))) if x.size else "-")
        rows.append([name, str(len(members)), *cells])
    return ["group", "cases", *policies], rows


def markdown(report: dict[str, Any]) -> str:
    """quality.md: the held-out summary, the distance to the oracle, every case, the losses."""
    cfg, base = report["config"], report["config"]["baseline"]
    m, code = report["machine"], report["code"]
    held = [c for c in report["cases"] if c["role"] == "held-out"]
    tuning = [c for c in report["cases"] if c["role"] == "tuning"]
    lines = [
        f"# Scheduling quality: each policy against `{base}`",
        "",
        f"Written by `.venv/bin/python -m bench.quality{' --quick' if cfg['quick'] else ''}"
        f"{' --tuning' if cfg.get('tuning') else ''}"
        f"{_checkpoint_flag(cfg)}` at"
        f" commit {code['commit']} (scheduling/ modified: {code['scheduling_modified']}), on"
        f" {m['cpus_usable'] or m['cpus']} usable CPUs (load average {m['load_average_1m']}),"
        f" in {report['wall_s']:.0f} s. Philly: {cfg['philly']['source']}; cluster sizes"
        f" {cfg['philly']['gpus']}; families {', '.join(cfg['families'])}, seeds {cfg['seeds']},"
        f" {cfg['family_jobs']} jobs each. {_checkpoints(cfg)}",
        "",
        *(
            [
                "**scheduling/ changed while the cases ran: these figures mix two versions of the"
                " engine; run again.**",
                "",
            ]
            if report["code_changed_during_run"]
            else []
        ),
        f"Ratios are policy / `{base}` (below 1 is better, except goodput), Jain fairness is a"
        " difference (above 0 is better). Geo-mean leaves out zero ratios. 'No worse' counts"
        " the cases where the policy is at least as good as the baseline on that metric.",
        "",
        *(
            [
                f"## Tuning cases ({len(tuning)}): where settings are chosen",
                "",
                *_md_table(METRIC_HEADER, _metric_rows(report["metrics"], report["tuning"], base)),
                "",
            ]
            if cfg.get("tuning")
            else []
        ),
        f"## Held-out cases ({len(held)})",
        "",
        *_md_table(METRIC_HEADER, _metric_rows(report["metrics"], report["held_out"], base)),
        "",
        "### Distance to the SRTF oracle (avg JCT / oracle avg JCT, held-out)",
        "",
        *_md_table(
            ["policy", "cases", "geo-mean", "median", "min .. max"],
            [
                [
                    p,
                    str(s["n"]),
                    _fmt(s["geomean"]),
                    _fmt(s["median"]),
                    f"{_fmt(s['min'])} .. {_fmt(s['max'])}",
                ]
                for p, s in report["held_out"]["jct_over_oracle"].items()
            ],
        ),
        "",
        "By group (geo-mean of avg JCT / oracle avg JCT, held-out):",
        "",
        *_md_table(*oracle_by_group(held)),
        "",
    ]
    case_header = [
        "case",
        "load",
        f"{base} avg JCT (s)",
        f"{CANDIDATE} avg JCT (s)",
        "oracle avg JCT (s)",
        f"{CANDIDATE}/{base} JCT",
        f"{CANDIDATE}/{base} p99 wait >= {cfg['big_job_gpus']} GPUs",
        f"Jain {CANDIDATE}-{base}",
        f"preemptions {CANDIDATE} / {base}",
        f"{CANDIDATE}/oracle",
        f"{base}/oracle",
    ]
    losses = [
        [
            r["name"],
            mt["label"],
            _fmt(v["value"], 3 if mt["compare"] == "ratio" else 4, signed=mt["compare"] != "ratio"),
            _fmt(r["results"][CANDIDATE].get(mt["key"])),
            _fmt(r["results"][base].get(mt["key"])),
        ]
        for r in held
        for mt in report["metrics"]
        if (v := r["versus_baseline"].get(CANDIDATE, {}).get(mt["key"])) and v["no_worse"] is False
    ]
    lines += [
        f"## Held-out cases where `{CANDIDATE}` is worse than `{base}`"
        f" ({len(losses)} case-metrics)",
        "",
        *(
            _md_table(["case", "metric", "ratio / difference", CANDIDATE, base], losses)
            if losses
            else ["None."]
        ),
        "",
        "## Every held-out case",
        "",
        *_md_table(case_header, _case_rows(held, base)),
        "",
        f"## Tuning cases ({len(tuning)}), not in the summaries above",
        "",
        *(_md_table(case_header, _case_rows(tuning, base)) if tuning else ["None."]),
        "",
    ]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """Per case, berth's avg JCT over the baseline's, grouped by family and cluster size."""
    base = report["config"]["baseline"]
    groups: dict[str, list[tuple[float, bool]]] = {}
    for r in report["cases"]:
        value = r["versus_baseline"].get(CANDIDATE, {}).get("avg_jct_s", {}).get("value")
        if value:
            groups.setdefault(r["group"], []).append((value, r["role"] == "tuning"))
    fig = Figure(figsize=(max(6.0, 1.1 * len(groups) + 2), 4.5), layout="constrained")
    ax = fig.add_subplot()
    rng = np.random.default_rng(0)  # jitter only, so that points of one group do not overlap
    for x, points in enumerate(groups.values()):
        for value, is_tuning in points:
            ax.scatter(
                x + rng.uniform(-0.2, 0.2),
                value,
                s=30,
                facecolors="none" if is_tuning else "tab:blue",
                edgecolors="tab:blue",
                label="tuning case" if is_tuning else "held-out case",
            )
    ax.axhline(1.0, color="black", linewidth=1)
    names = [f"{g} ({len(points)})" for g, points in groups.items()]
    ax.set_xticks(range(len(groups)), names, rotation=30, ha="right")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.set_ylabel(f"avg JCT, {CANDIDATE} / {base}")
    ax.set_title(f"{CANDIDATE} against {base}, one point per case (below 1: {CANDIDATE} better)")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    if unique:
        ax.legend(unique.values(), unique.keys(), loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Render saved quality reports again (.md, .png).")
    p.add_argument("reports", nargs="+", type=Path, help="quality JSON files (bench/results/)")
    for path in p.parse_args(argv).reports:
        report = json.loads(path.read_text())
        path.with_suffix(".md").write_text(markdown(report))
        plot(report, path.with_suffix(".png"))


if __name__ == "__main__":
    main()
