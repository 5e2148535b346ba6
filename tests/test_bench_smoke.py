"""The benchmarks run end to end on tiny sizes and write the JSON they promise (not timings)."""

from __future__ import annotations

import importlib
import io
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from rich.console import Console
from shared_data import philly_dir

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load(name: str) -> ModuleType:
    """bench.<name>, with the repository root importable (bench/ is not installed)."""
    root = str(BENCH.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module(f"bench.{name}")


def quiet() -> Console:
    return Console(file=io.StringIO(), width=150)


def assert_stats(s: dict[str, Any], keys: tuple[str, ...]) -> None:
    assert set(keys) <= set(s)
    assert all(isinstance(s[k], (int, float)) for k in keys)
    assert s["min"] <= s["median"] <= s["max"]


def test_cycle_bench_tiny(tmp_path: Path) -> None:
    out = tmp_path / "cycle.json"
    report = load("cycle_bench").main(
        ["--nodes", "50", "--pending", "200", "--runs", "3", "--warmup-runs", "1", "--out",
         str(out)],
        console=quiet(),
    )  # fmt: skip
    assert json.loads(out.read_text()) == report
    assert report["benchmark"] == "cycle"
    assert report["config"]["nodes"] == 50 and report["config"]["pending"] == 200
    assert report["target"]["p99_ms"] == 20
    assert {"python", "cpus", "reference_ms_before", "reference_ms_after"} <= set(report["machine"])
    assert set(report["code"]) == {"commit", "scheduling_modified", "scheduling_sha256"}
    pairs = [(r["policy"], r["scenario"]) for r in report["results"]]
    assert pairs == [(p, s) for p in ("berth", "quota-spread", "fifo") for s in ("static", "apply")]
    for r in report["results"]:
        assert r["runs"] == 3
        assert_stats(r["ms"], ("min", "median", "mean", "p90", "p99", "max"))
        assert r["ms"]["median"] <= r["ms"]["p90"] <= r["ms"]["p99"] <= r["ms"]["max"]
        assert_stats(r["examined"], ("min", "median", "max"))
        assert r["examined"]["min"] >= 1
        state = r["state"]
        assert state["pending"] == 200  # the queue the scenario starts from
        assert state["running"] > 0 and 0 < state["gpu_busy"] <= 1
        assert 1 <= state["classes"] <= 200
        assert set(r["gc"]) == {"ms_total", "ms_max", "cycles_with_full_collection"}
        assert isinstance(r["meets_target"], bool)


def test_cycle_bench_static_sees_the_same_state_every_run(tmp_path: Path) -> None:
    report = load("cycle_bench").main(
        ["--nodes", "20", "--pending", "50", "--runs", "3", "--policies", "berth",
         "--scenarios", "static", "--mix", "philly", "--out", str(tmp_path / "c.json")],
        console=quiet(),
    )  # fmt: skip
    (r,) = report["results"]
    # Nothing is applied between runs, so every run examines exactly as many jobs.
    assert r["examined"]["min"] == r["examined"]["max"]
    assert r["admitted_per_cycle"]["min"] == r["admitted_per_cycle"]["max"]


def test_cycle_bench_rejects_an_unknown_policy(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        load("cycle_bench").main(["--policies", "nope", "--out", str(tmp_path / "c.json")])


def test_philly_bench_first_300_jobs(tmp_path: Path) -> None:
    trace_dir = philly_dir()
    out = tmp_path / "philly.json"
    report = load("philly_bench").main(
        ["--trace-dir", str(trace_dir), "--jobs", "300", "--runs", "1", "--out", str(out)],
        console=quiet(),
    )
    assert json.loads(out.read_text()) == report
    assert report["benchmark"] == "philly"
    assert report["target"] == {
        "median_wall_s": 60,
        "cores": 2,
        "jobs": 82_247,
        "gpus": 512,
        "policy": "berth",
    }
    assert report["config"]["jobs"] == 300 and report["config"]["trace_jobs"] == 82_247
    assert report["machine"]["reference_ms_before"] > 0
    assert report["import_s"] > 0 and report["load_s"] > 0
    (r,) = report["results"]
    assert r["policy"] == "berth" and r["jobs"] == 300
    assert len(r["runs"]) == 1
    run = r["runs"][0]
    assert set(run) == {"wall_s", "cpu_s", "cycles", "events", "unfinished"}
    assert run["cycles"] > 0 and run["unfinished"] == 0
    assert run["events"] >= 2 * 300  # a submit and an outcome for every job
    assert_stats(r["wall_s"], ("median", "min", "max"))
    assert r["meets_target"] is None  # a part of the trace says nothing about the target


def test_kube_bench_tiny(tmp_path) -> None:
    """Engine + Kubernetes runtime on a real API server, tiny: every job goes through."""
    from bench import kube_bench

    out = tmp_path / "kube.json"
    report = kube_bench.main(["--nodes", "4", "--jobs", "12", "--teams", "2", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["result"] == report["result"]
    result = report["result"]
    assert result["jobs"] == 12 and result["pods"] >= 12  # gangs have several pods
    assert result["jobs_admitted_per_s"] > 0 and result["pods_created_per_s"] > 0


def test_kube_bench_tiny_on_kwok(tmp_path) -> None:
    """The same with KWOK playing the kubelets: pods run on their own time, each gang is polled
    more than once (through the watch) before it ends, and every job goes through."""
    from bench import kube_bench

    out = tmp_path / "kube.json"
    argv = ["--nodes", "4", "--jobs", "12", "--teams", "2", "--kubelet", "kwok"]
    report = kube_bench.main([*argv, "--run-s", "1", "--poll-s", "0.3", "--out", str(out)])
    result = report["result"]
    assert result["kubelet"] == "kwok" and result["watch"] is True
    assert result["jobs"] == 12 and result["pods"] >= 12
    assert result["polls"] > 12  # gangs ran 1 to 2 s and were polled every 0.3 s
    assert result["kubelet_standin_s"] == 0


def test_kube_floor_tiny_beside_kube_bench(tmp_path) -> None:
    """The floor (bare pods, no Berth) and kube_bench alternately on the same KWOK cluster: every
    job through both, the ratio and each process's CPU time reported."""
    from bench import kube_floor

    out = tmp_path / "floor.json"
    argv = ["--nodes", "4", "--jobs", "12", "--teams", "2", "--run-s", "1", "--compare", "1"]
    report = kube_floor.main([*argv, "--out", str(out)])
    assert json.loads(out.read_text())["berth_over_floor"] == report["berth_over_floor"]
    berth, floor = (r["result"] for r in report["runs"])
    assert floor["jobs"] == berth["jobs"] == 12
    assert floor["pods"] == berth["pods"]  # the same jobs, drawn from the same seed
    assert floor["requests"] == 2 * floor["pods"]  # a create and a delete each
    assert report["berth_over_floor"] == [
        round(berth["jobs_admitted_per_s"] / floor["jobs_per_s"], 3)
    ]
    # Every process found and measured; a run this small may round KWOK's CPU to 0.0 s.
    for run in (berth, floor):
        assert {"client", "kube-apiserver", "etcd", "kwok"} <= set(run["cpu_s"])
    assert berth["cpu_s"]["kube-apiserver"] + floor["cpu_s"]["kube-apiserver"] > 0


def test_the_floor_with_berths_pod_bodies_runs_every_job(tmp_path) -> None:
    """`--pods berth`: the floor sends the manifests Berth's runtime makes, and KWOK ends them
    as it ends bare ones (the same label), so every job finishes."""
    from bench import kube_floor

    out = tmp_path / "floor.json"
    argv = ["--nodes", "4", "--jobs", "12", "--teams", "2", "--run-s", "1", "--pods", "berth"]
    report = kube_floor.main([*argv, "--out", str(out)])
    [floor] = (r["result"] for r in report["runs"])
    assert (floor["jobs"], floor["pod_bodies"]) == (12, "berth")
    assert floor["requests"] == 2 * floor["pods"]


def test_berths_pod_bodies_in_the_floor_are_the_runtimes_manifests() -> None:
    floor = load("kube_floor")
    from berth.runtime.kubernetes.pods import LAUNCH

    bodies = floor.BerthPods(["n-a", "n-b"]).bodies("berth-t1", "j7", ["n-b", "n-a"], 8)
    assert [b["metadata"]["name"] for b in bodies] == ["j7-0", "j7-1"]  # the floor's names
    assert [b["spec"]["nodeName"] for b in bodies] == ["n-b", "n-a"]
    for b in bodies:
        meta = b["metadata"]
        assert meta["labels"][floor.LABEL] == "berth" and LAUNCH in meta["annotations"]
        assert "ownerReferences" not in meta and meta["namespace"] == "berth-t1"
        env = {e["name"] for e in b["spec"]["containers"][0]["env"]}
        assert {"RANK", "WORLD_SIZE", "MASTER_ADDR", "PET_NNODES"} <= env


def test_floor_first_fit_packs_and_gives_back() -> None:
    fit = load("kube_floor").FirstFit(["a", "b", "c"])
    [used] = fit.place(1, 3)
    assert fit.place(1, 5) == [used]  # the fullest node that fits, not an empty one
    assert fit.free[used] == 0
    gang = fit.place(2, 8)
    assert gang is not None and len(set(gang)) == 2 and used not in gang
    assert fit.place(1, 1) is None and fit.total == 0
    fit.release(gang, 8)
    assert fit.place(3, 8) is None  # only two nodes are empty: nothing is held by the try
    assert fit.total == 16 and sorted(fit.free.values()) == [0, 8, 8]


def test_lifecycle_bench_parts_without_airflow(tmp_path: Path) -> None:
    """The whole benchmark needs an Airflow standalone (minutes); its parts that can break
    silently are checked here: the DAG copy with another poll_s, and the summary."""
    bench = load("lifecycle_bench")
    folder = bench.dags_folder(tmp_path, 0.5)
    text = (folder / "berth_job.py").read_text()
    assert 'gpu_job(FROM_PARAMS, group_id="job", poll_s=0.5)' in text
    assert bench.dags_folder(tmp_path, None) == BENCH.parent / "dags"
    rounds = [
        {"trigger": [{"trigger_to_start": t, "validate_running": 0.4}], "freed": {"x": f}}
        for t, f in ((5.0, 0.1), (6.0, 0.3), (4.0, 0.2))
    ]
    summary = bench.summarize(rounds)
    assert summary["trigger"]["trigger_to_start"] == {
        "median": 5.0, "min": 4.0, "max": 6.0, "n": 3,
    }  # fmt: skip
    assert summary["freed"]["x"]["median"] == 0.2


def test_easy_backfill_bench_tiny(tmp_path: Path) -> None:
    out = tmp_path / "easy.json"
    report = load("easy_backfill").main(["--jobs", "60", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert [c["seed"] for c in report["cases"]] == [0, 10, 11, 12, 13, 1, 2, 3, 4]
    for case in report["cases"]:
        for pol in ("berth", "berth-no-easy"):
            assert case[pol]["avg_jct_s"] > 0 and case[pol]["timed_out"] == 0
    assert set(report["summary"]) == {"tuning", "held-out"}


def test_model_choice_bench_tiny(tmp_path: Path) -> None:
    out = tmp_path / "choice.json"
    report = load("model_choice").main(["--jobs", "60", "--workers", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert len(report["cases"]) == 2 * 3 * 4  # families x loads x seeds
    light = [c for c in report["cases"] if c["load"] == "0.3-0.5"]
    assert light and all(0.25 <= c["offered_load"] <= 0.55 for c in light)
    for case in report["cases"]:
        for pol in report["policies"]:
            assert case[pol]["avg_jct_s"] > 0
    assert {(s["family"], s["load"]) for s in report["summary"]} == {
        (f, load) for f in ("models", "models-quota") for load in ("as drawn", "0.6-0.8", "0.3-0.5")
    }


def test_store_bench_tiny(tmp_path: Path) -> None:
    """Both backends (CI has PostgreSQL), both queue sizes, every mode; the JSON it promises."""
    out = tmp_path / "store.json"
    report = load("store_bench").main(
        ["--nodes", "30", "--pending", "20,100", "--runs", "3", "--warmup-runs", "1",
         "--rebuild-runs", "2", "--contention-s", "1", "--out", str(out)],
        console=quiet(),
    )  # fmt: skip
    assert json.loads(out.read_text()) == report
    assert report["benchmark"] == "store"
    seen = [(r["backend"], r["pending"], r["mode"]) for r in report["results"]]
    assert seen == [
        (b, n, m)
        for n in (100, 20)
        for b in ("sqlite", "postgres")
        for m in ("cycles", "rebuild", "contention")
    ]
    for r in report["results"]:
        assert r["running"] > 0 and r["build_ms"] > 0
        if r["mode"] == "contention":
            c = r["contention"]
            assert c["cycles"] >= 1
            assert_stats(c["lock_wait_ms"], ("min", "median", "p99", "max"))
            assert_stats(c["submit_ms"], ("min", "median", "p99", "max"))
        else:
            res = r["result"]
            assert res["runs"] == (3 if r["mode"] == "cycles" else 2)
            assert res["median_ms"] <= res["p99_ms"]
            assert_stats(res["locked_ms"], ("min", "median", "p99", "max"))
            assert res["decided_again"] == 0  # nobody else writes in these modes
