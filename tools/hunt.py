"""Fresh examples for the engine's property checks, in parallel, for as long as you give it.

Each worker draws random seeds; for each seed it runs 60 of the crowded scenarios of
`tests/test_shortcuts.py` (generated, not shrunk) through every policy with and without the
speed shortcuts (the decisions must be the same), and through every topology-aware policy with
the event-log checks and the simulator's audit (every rule, the nominal-deficit bound and the
per-model keys included), and, under Berth's victim rule, looks for two teams taking the same
jobs from each other back and forth (`ping_pong`). A failing scenario is written to
`<out>/fails.txt` with its seed and the scenario itself (and at once to
`<out>/fails-<pid>.txt`, so a hunt cut short keeps it), ready to keep as a regression case
(`tests/data/shortcuts_fixed/`, `tests/data/audit_fixed/`).

What the test suite does with one fresh seed per run, this does with as many as the machine's
cores and the minutes allow: the lent GPU machines' 16 cores found the cases kept in
`tests/data/`. Run: .venv/bin/python tools/hunt.py --seconds 300 --workers 2 --out /tmp/hunt
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_clock = time.time  # the workers' deadline clock (a test gives its own)


def _one_seed(s0: int) -> tuple[int, str | None]:
    """60 fresh examples drawn from seed `s0`: how many ran, and what failed, if anything."""
    import scenario_gen as tp
    import test_shortcuts as ts
    from hypothesis import Phase, given, seed, settings

    from scheduling.simulator.audit import audit_or_raise

    count, last = [0], [None]

    @seed(s0)
    @settings(
        tp.PROPERTY, derandomize=False, database=None, max_examples=60, phases=[Phase.generate]
    )
    @given(s=ts.crowded())
    def check(s: tp.Scenario) -> None:
        count[0] += 1
        last[0] = s
        ts._same_decisions(s)
        for name in tp.TOPOLOGY_AWARE:
            result = tp._simulate(s, name)
            tp._check_log(result.events)
            audit_or_raise(result.events, s.cluster, s.teams, s.policy(name), s.jobs)
            # Under Kueue's victim rule (a victim's team may end below its nominal) reclaims
            # may go back and forth as load moves, by design (the replay still settles);
            # under Berth's they may not (decision 0022).
            keeps = s.policy(name).victim_keeps_nominal
            if keeps and (told := ping_pong(result.events)) is not None:
                raise AssertionError(f"policy {name}: {told}")

    try:
        check()
    except Exception as e:  # any failure is a finding to report, with its scenario
        lines = traceback.format_exc().splitlines()
        said = [ln for ln in lines if "Error" in ln or "differ" in ln or "violation" in ln]
        said.append(f"{type(e).__name__}: {e}")  # a Livelock's line names none of those words
        return count[0], f"seed {s0}\n" + "\n".join(said)[-3000:] + f"\n{last[0]!r}"
    return count[0], None


# Times one job is taken by the same other team, each way. A livelock takes the same jobs
# back and forth (they never finish); teams trading reclaims of different jobs as load moves
# are the quotas at work, and a finite trace ends them. Counted per team, 800 fresh replays
# (every policy) showed at most 2 each way, but a 7-minute hunt on 15 cores found berth-las-gpu
# at 5 and 5 between two teams over 18,000 s, no job taken more than twice (more
# preemptions inside each team move its usage more often; seed 2321700968): so the same
# job, not the team. Under Kueue's victim rule, which lets a team reclaim what it lost
# below its nominal, a 14-minute hunt found 6 to 8 per team (kueue-tas, berth-quick-reclaim).
PING_PONG = 5


def ping_pong(events: list[dict]) -> str | None:
    """Two teams that each took one job of the other's at least PING_PONG times: the slow
    form of a livelock (one reclaim undone by the other team's, again and again), which the
    simulator's guard of 10,000 preemptions of one job misses when each turn waits a minimum
    run time. None if there are none."""
    team = {e["job"]: e["team"] for e in events if e["type"] == "submit"}
    taken = Counter(
        (e["job"], team[e["by"]]) for e in events if e["type"] == "preempt" and e.get("by") in team
    )
    most: dict[tuple[str, str], tuple[int, str]] = {}  # (victims' team, takers') -> most
    for (job, by), n in taken.items():
        key = (team[job], by)
        most[key] = max(most.get(key, (0, "")), (n, job))
    for (a, b), (n, job) in sorted(most.items()):
        back, other = most.get((b, a), (0, ""))
        if a < b and min(n, back) >= PING_PONG:
            return (
                f"teams {a} and {b} took the same jobs back and forth: {job} taken by {b}"
                f" {n} times, {other} by {a} {back} times"
            )
    return None


def _worker(args: tuple[float, Path]) -> tuple[int, int, list[str]]:
    """Seeds tried, examples run, and a report per failing seed. Each failing seed is also
    appended to `<out>/fails-<pid>.txt` at once, and each seed's end printed: a hunt stopped
    from outside (a time limit on a lent machine) keeps what it found."""
    seconds, out = args
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
    rng = random.Random(os.urandom(8))
    end = _clock() + seconds
    seeds = examples = 0
    fails: list[str] = []
    while _clock() < end:
        s0 = rng.getrandbits(32)
        ran, failed = _one_seed(s0)
        seeds, examples = seeds + 1, examples + ran
        print(f"seed {s0}: {ran} examples, {'FAILED' if failed else 'ok'}", flush=True)
        if failed is not None:
            fails.append(failed)
            with open(out / f"fails-{os.getpid()}.txt", "a") as f:
                f.write(failed + "\n=====\n")
    return seeds, examples, fails


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=300.0, help="how long each worker draws")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", type=Path, default=Path("hunt-out"), help="where fails.txt goes")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    with mp.Pool(a.workers) as pool:
        results = pool.map(_worker, [(a.seconds, a.out)] * a.workers)
    fails = [f for _, _, fs in results for f in fs]
    (a.out / "fails.txt").write_text("\n=====\n".join(fails) + ("\n" if fails else ""))
    seeds, examples = sum(r[0] for r in results), sum(r[1] for r in results)
    print(f"hunt: {a.workers} workers, {seeds} seeds, {examples} examples, {len(fails)} failing")
    print(f"failing scenarios: {a.out / 'fails.txt'}" if fails else "no failure")
    return 1 if fails else 0


if __name__ == "__main__":
    raise SystemExit(main())
