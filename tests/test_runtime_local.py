"""The local runtime with real processes: environment, rendezvous, exit codes, stop, reattach
from another process, lost replicas, time limits and log streaming.

Replicas are small `python -c` programs. Where a test waits, it polls a real condition (a file,
a process, the gang's state) with a deadline; replicas that must stay up block on a file the
test creates, or sleep as the long-running work that a stop must end.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from builders import cluster
from hypothesis import given, settings
from hypothesis import strategies as st
from waiting import wait_for

from berth.runtime import GangStatus, LaunchError, LocalLaunch, LocalRuntime, LogCursor
from berth.runtime.base import replica_env
from berth.runtime.inventory import DEVICES_LABEL
from berth.runtime.shim import group_members, proc_stat
from scheduling.config import parse_cluster
from scheduling.jobs import Placement, ReplicaPlacement

PY = sys.executable


def alive(pid: int) -> bool:
    st = proc_stat(pid)
    return st is not None and st[0] not in "ZX"


def finish(rt: LocalRuntime, launch: LocalLaunch) -> GangStatus:
    return wait_for(lambda: (s := rt.poll(launch)).state != "running" and s, "the gang to end")


def two_nodes() -> Any:
    return cluster(nodes=2, gpus=4, groups=1)


def program(body: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(body)]


@pytest.fixture
def rt(tmp_path: Path) -> Iterator[LocalRuntime]:
    """A runtime under tmp_path/runtime; whatever a failed test left running is stopped."""
    runtime = LocalRuntime(tmp_path / "runtime", grace_s=5.0)
    yield runtime
    for attempt_dir in runtime.root.glob("*/attempt-*"):
        launch = runtime.reattach(attempt_dir.parent.name, int(attempt_dir.name.split("-")[1]))
        if launch is not None:
            runtime.stop(launch, grace_s=1.0)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path / "work"


GANG = Placement((ReplicaPlacement(0, (1, 2)), ReplicaPlacement(1, (3,))), "cluster")

RENDEZVOUS = """
    import json, os, socket, time
    keys = ("CUDA_VISIBLE_DEVICES", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
            "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "BERTH_JOB_ID",
            "BERTH_ATTEMPT", "BERTH_NODE", "MY_VAR", "MLFLOW_RUN_ID", "BERTH_CHECKPOINT_DIR",
            "PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR",
            "PET_MASTER_PORT")
    print("ENV " + json.dumps({k: os.environ.get(k) for k in keys}), flush=True)
    addr = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    if os.environ["RANK"] == "0":
        server = socket.create_server(addr)
        server.settimeout(30)
        conn, _ = server.accept()
        print("GOT " + conn.recv(100).decode(), flush=True)
    else:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(addr, timeout=5).sendall(b"hello from rank 1")
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
"""


def test_gang_gets_its_gpus_and_ranks_and_rendezvous(rt: LocalRuntime, workdir: Path) -> None:
    launch = rt.launch(
        "rdv",
        1,
        program(RENDEZVOUS),
        GANG,
        two_nodes(),
        env={"MY_VAR": "x"},
        workdir=workdir,
        extra_env={"MLFLOW_RUN_ID": "run-7"},
    )
    status = finish(rt, launch)
    assert status.state == "succeeded", status.message
    assert [r.exit_code for r in status.replicas] == [0, 0]
    lines, _ = rt.logs(launch)
    envs = {
        int(line.split()[1].rstrip("]")): json.loads(line.split(" ENV ", 1)[1])
        for line in lines
        if " ENV " in line
    }
    assert envs[0]["CUDA_VISIBLE_DEVICES"] == "1,2"
    assert envs[1]["CUDA_VISIBLE_DEVICES"] == "3"
    assert [envs[r]["RANK"] for r in (0, 1)] == ["0", "1"]
    assert {envs[r]["WORLD_SIZE"] for r in (0, 1)} == {"2"}
    assert {envs[r]["MASTER_PORT"] for r in (0, 1)} == {str(launch.master_port)}
    # One replica on each declared node: each is rank 0 of its node, and the nodes are told apart.
    assert [envs[r]["LOCAL_RANK"] for r in (0, 1)] == ["0", "0"]
    assert [envs[r]["NODE_RANK"] for r in (0, 1)] == ["0", "1"]
    assert [envs[r]["BERTH_NODE"] for r in (0, 1)] == ["n-000", "n-001"]
    assert envs[1]["BERTH_JOB_ID"] == "rdv" and envs[1]["BERTH_ATTEMPT"] == "1"
    assert envs[0]["MY_VAR"] == "x" and envs[0]["MLFLOW_RUN_ID"] == "run-7"
    assert "[rank 0] GOT hello from rank 1" in lines
    # torchrun's variables: each replica is a torchrun node with a process per GPU it holds.
    assert [envs[r]["PET_NODE_RANK"] for r in (0, 1)] == ["0", "1"]
    assert [envs[r]["PET_NPROC_PER_NODE"] for r in (0, 1)] == ["2", "1"]
    assert {envs[r]["PET_NNODES"] for r in (0, 1)} == {"2"}
    assert {envs[r]["PET_MASTER_ADDR"] for r in (0, 1)} == {launch.master_addr}
    assert {envs[r]["PET_MASTER_PORT"] for r in (0, 1)} == {str(launch.master_port)}
    assert {envs[r]["BERTH_CHECKPOINT_DIR"] for r in (0, 1)} == {str(rt.checkpoint_dir("rdv"))}


SAVE_OR_RESUME = """
    import os, pathlib
    ckpt = pathlib.Path(os.environ["BERTH_CHECKPOINT_DIR"]) / "step"
    print("FOUND " + (ckpt.read_text() if ckpt.exists() else "nothing"), flush=True)
    ckpt.write_text("attempt " + os.environ["BERTH_ATTEMPT"])
"""


def test_a_later_attempt_finds_what_an_earlier_one_saved(rt: LocalRuntime, workdir: Path) -> None:
    one = Placement((ReplicaPlacement(0, (0,)),), "node")
    found = []
    for attempt in (1, 2):
        launch = rt.launch(
            "ck", attempt, program(SAVE_OR_RESUME), one, two_nodes(), env={}, workdir=workdir
        )
        assert finish(rt, launch).state == "succeeded"
        found += [line.split("FOUND ")[1] for line in rt.logs(launch)[0] if "FOUND " in line]
    assert found == ["nothing", "attempt 1"]
    # Another job has a place of its own.
    other = rt.launch(
        "other", 1, program(SAVE_OR_RESUME), one, two_nodes(), env={}, workdir=workdir
    )
    assert finish(rt, other).state == "succeeded"
    assert any("FOUND nothing" in line for line in rt.logs(other)[0])


@settings(derandomize=True, deadline=None, database=None, max_examples=100)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3)), min_size=1, max_size=8))
def test_rank_variables_are_consistent_for_any_placement(spec: list[tuple[int, int]]) -> None:
    placement = Placement(tuple(ReplicaPlacement(n, (g,)) for n, g in spec), "cluster")
    launch = LocalLaunch(
        job_id="p",
        attempt=1,
        launched_at=0.0,
        master_addr="127.0.0.1",
        master_port=1,
        dir="/nowhere",
        workdir="/nowhere",
        command=("true",),
        boot_id="b",
        replicas=tuple(
            {"rank": i, "node": r.node, "node_name": f"n{r.node}", "gpus": r.gpus, "log": "x"}
            for i, r in enumerate(placement.replicas)
        ),
    )
    envs = [replica_env(launch, r) for r in launch.replicas]
    assert [e["RANK"] for e in envs] == [str(i) for i in range(len(spec))]
    assert [e["PET_NODE_RANK"] for e in envs] == [e["RANK"] for e in envs]
    assert {e["PET_NNODES"] for e in envs} == {str(len(spec))}
    assert {e["WORLD_SIZE"] for e in envs} == {str(len(spec))}
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == [str(g) for _, g in spec]
    # one MLflow system-metrics node id per rank, so a gang's ranks are told apart
    assert len({e["MLFLOW_SYSTEM_METRICS_NODE_ID"] for e in envs}) == len(envs)
    by_node: dict[str, list[dict[str, str]]] = {}
    for e in envs:
        by_node.setdefault(e["NODE_RANK"], []).append(e)
    assert sorted(by_node, key=int) == [str(i) for i in range(len({n for n, _ in spec}))]
    for group in by_node.values():
        assert [e["LOCAL_RANK"] for e in group] == [str(i) for i in range(len(group))]
        assert {e["LOCAL_WORLD_SIZE"] for e in group} == {str(len(group))}
        assert len({e["BERTH_NODE"] for e in group}) == 1


def test_a_shared_gpu_gets_its_one_gpu_and_a_share_hint(rt: LocalRuntime, workdir: Path) -> None:
    placement = Placement((ReplicaPlacement(0, (2,), share=250),), "gpu_group")
    cmd = program(
        "import os; print(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['BERTH_GPU_SHARE'])"
    )
    launch = rt.launch("share", 1, cmd, placement, two_nodes(), env={}, workdir=workdir)
    assert finish(rt, launch).state == "succeeded"
    assert rt.logs(launch)[0] == ["[rank 0] 2 0.25"]


def test_a_node_of_one_model_on_a_mixed_machine_gets_its_own_devices(
    rt: LocalRuntime, workdir: Path
) -> None:
    """A machine of two models is a node per model (berth/runtime/inventory.py), each
    numbered from 0 by the engine: the replica sees the machine's own device indices."""
    mixed = parse_cluster(
        {
            "nodes": [
                {"name": "ws-a100", "gpus": 2, "gpu_model": "A100",
                 "labels": {DEVICES_LABEL: "0,2"}},
                {"name": "ws-t4", "gpus": 2, "gpu_model": "T4", "labels": {DEVICES_LABEL: "1,3"}},
            ]
        }
    )  # fmt: skip
    placement = Placement((ReplicaPlacement(1, (1,)), ReplicaPlacement(0, (0, 1))), "cluster")
    cmd = program("import os; print(os.environ['CUDA_VISIBLE_DEVICES'])")
    launch = rt.launch("mixed", 1, cmd, placement, mixed, env={}, workdir=workdir)
    assert finish(rt, launch).state == "succeeded"
    assert sorted(rt.logs(launch)[0]) == ["[rank 0] 3", "[rank 1] 0,2"]


def test_success_and_a_failed_rank_stops_the_other(rt: LocalRuntime, workdir: Path) -> None:
    ok = rt.launch("ok", 1, program("print('fine')"), GANG, two_nodes(), env={}, workdir=workdir)
    assert finish(rt, ok).state == "succeeded"

    cmd = program("""
        import os, sys, time
        if os.environ["RANK"] == "1":
            print("rank 1 gives up", flush=True)
            sys.exit(3)
        open("rank0.pid", "w").write(str(os.getpid()))
        time.sleep(600)  # the long-running work that the failed gang must end
    """)
    bad = rt.launch("bad", 1, cmd, GANG, two_nodes(), env={}, workdir=workdir / "bad")
    pid0 = int(wait_for(lambda: _read(workdir / "bad" / "rank0.pid"), "rank 0 to start"))
    status = finish(rt, bad)
    assert status.state == "failed"
    assert (status.failed_rank, status.exit_code, status.reason) == (1, 3, "exit")
    assert status.log_tail[-1] == "rank 1 gives up"
    assert "rank 1 on node n-001 exited with code 3" in status.message
    rank0 = status.replicas[0]
    assert rank0.state == "exited" and rank0.stopped and rank0.signal == signal.SIGTERM
    assert not alive(pid0)
    # The verdict holds for any later poller, and stop after the end is harmless.
    rt.stop(bad)
    assert rt.poll(bad).failed_rank == 1 and rt.poll(bad).state == "failed"


GRANDPARENT = """
    import os, signal, subprocess, sys, time
    if os.environ.get("IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(f"tree-{os.environ['RANK']}.pids", "w").write(f"{os.getpid()} {child.pid}")
    time.sleep(600)
"""


@pytest.mark.parametrize("ignore_term", [False, True])
def test_stop_ends_the_whole_tree(rt: LocalRuntime, workdir: Path, ignore_term: bool) -> None:
    env = {"IGNORE_TERM": "1"} if ignore_term else {}
    launch = rt.launch("tree", 1, program(GRANDPARENT), GANG, two_nodes(), env=env, workdir=workdir)
    pids = [
        [int(p) for p in wait_for(lambda r=r: _read(workdir / f"tree-{r}.pids"), "pids").split()]
        for r in (0, 1)
    ]
    assert all(alive(p) for pair in pids for p in pair)
    assert rt.poll(launch).state == "running"
    rt.stop(launch, grace_s=1.0 if ignore_term else 10.0)
    assert not any(alive(p) for pair in pids for p in pair)  # grandchildren too
    status = rt.poll(launch)
    assert status.state == "stopped"
    want = signal.SIGKILL if ignore_term else signal.SIGTERM
    assert [(r.state, r.signal) for r in status.replicas] == [("exited", want)] * 2
    rt.stop(launch)  # idempotent, and safe with everything gone
    assert rt.poll(launch).state == "stopped"


LAUNCHER = """
import json, sys
from pathlib import Path
from scheduling.config import parse_cluster
from scheduling.jobs import Placement, ReplicaPlacement
from berth.runtime import LocalRuntime
root, work = Path(sys.argv[1]), Path(sys.argv[2])
cluster = parse_cluster({"nodes": [{"name": "box", "gpus": 2}]})
placement = Placement((ReplicaPlacement(0, (0,)), ReplicaPlacement(0, (1,))), "node")
cmd = [sys.executable, "-c", sys.argv[3]]
launch = LocalRuntime(root).launch("re", 2, cmd, placement, cluster, env={}, workdir=work)
print(json.dumps(launch.to_dict()))
"""

WAIT_FOR_GO = """
import os, pathlib, sys, time
deadline = time.monotonic() + 60
while not pathlib.Path("go").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(int(os.environ["RANK"]) + 5 if pathlib.Path("go").read_text() == "fail" else 0)
"""


def launch_elsewhere(root: Path, workdir: Path, replica: str) -> dict[str, Any]:
    """Launch from a separate Python process that exits at once, as an Airflow worker may."""
    done = subprocess.run(
        [PY, "-c", LAUNCHER, str(root), str(workdir), replica],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).parent.parent,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_reattach_from_the_manifest_after_the_launcher_exited(
    rt: LocalRuntime, workdir: Path
) -> None:
    root, work = rt.root, workdir
    handle = launch_elsewhere(root, work, WAIT_FOR_GO)
    fresh = LocalRuntime(root)
    launch = fresh.reattach("re", 2)
    assert launch is not None and launch.to_dict() == handle
    assert fresh.launch_from_dict(handle) == launch
    assert fresh.reattach("re", 3) is None
    assert fresh.poll(launch).state == "running"
    (work / "go").write_text("fail")
    status = finish(fresh, launch)
    assert status.state == "failed" and status.exit_code in (5, 6)
    codes = {r.rank: (r.exit_code, r.stopped) for r in status.replicas}
    assert codes[status.failed_rank] == (status.failed_rank + 5, False)


def test_a_replica_whose_wrapper_was_killed_is_lost(rt: LocalRuntime, workdir: Path) -> None:
    launch_elsewhere(rt.root, workdir, WAIT_FOR_GO)
    launch = LocalRuntime(rt.root, grace_s=5.0).reattach("re", 2)
    assert launch is not None and rt.poll(launch).state == "running"
    victim = launch.replicas[1]
    assert victim.pid is not None
    assert victim.pgid == victim.pid  # the wrapper leads the group its command runs in
    commands = wait_for(
        lambda: [p for p in group_members(victim.pid) if p != victim.pid], "the command"
    )
    os.kill(victim.pid, signal.SIGKILL)
    wait_for(lambda: not alive(victim.pid), "the wrapper to die")
    status = rt.poll(launch)
    assert status.state == "failed"
    assert (status.failed_rank, status.reason, status.exit_code) == (1, "lost", None)
    assert status.replicas[1].state == "lost"
    assert status.replicas[0].state == "exited" and status.replicas[0].stopped
    assert not any(alive(p) for p in commands)  # the orphaned command was ended too


def test_time_limit_is_enforced_by_the_wrapper(rt: LocalRuntime, workdir: Path) -> None:
    one = Placement((ReplicaPlacement(0, (0,)),), "gpu_group")
    cmd = program("import time; print('working', flush=True); time.sleep(600)")
    launch = rt.launch("slow", 1, cmd, one, two_nodes(), env={}, workdir=workdir, time_limit_s=1)
    status = finish(rt, launch)
    assert status.state == "failed" and status.reason == "time_limit"
    assert status.replicas[0].timed_out and status.started_at == launch.launched_at
    assert "time limit" in status.message
    assert any("time limit reached" in line for line in status.log_tail)


def test_logs_stream_every_line_exactly_once(rt: LocalRuntime, workdir: Path) -> None:
    cmd = program("""
        import os, pathlib, sys, time
        r = os.environ["RANK"]
        def wait(name):
            deadline = time.monotonic() + 60
            while not pathlib.Path(name).exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        for i in range(100):
            print(f"line {i} of {r}", flush=True)
        wait("go")
        sys.stdout.write("line 100 ")  # half a line, until the test has looked
        sys.stdout.flush()
        wait("go2")
        sys.stdout.write(f"of {r}\\n")
        for i in range(101, 200):
            sys.stdout.write(f"line {i} of {r}\\n")
            if i % 7 == 0:
                sys.stdout.flush()
        sys.stdout.write(f"no newline {r}")
    """)
    launch = rt.launch("logs", 1, cmd, GANG, two_nodes(), env={}, workdir=workdir)
    seen: list[str] = []
    cursor: LogCursor | None = None

    def read() -> None:
        nonlocal cursor
        lines, cursor = rt.logs(launch, cursor)
        cursor = LogCursor.from_dict(json.loads(json.dumps(cursor.to_dict())))  # as a trigger
        seen.extend(lines)

    wait_for(lambda: read() or len(seen) >= 200, "the first 100 lines of each rank")
    assert len(seen) == 200
    (workdir / "go").write_text("")
    logs = [Path(r.log) for r in launch.replicas]
    wait_for(lambda: all(p.read_text().endswith("line 100 ") for p in logs), "half lines")
    read()
    assert len(seen) == 200  # half a line is held back
    (workdir / "go2").write_text("")
    while rt.poll(launch).state == "running":
        read()
    read()
    read()  # nothing new after the end
    for r in (0, 1):
        mine = [line for line in seen if line.startswith(f"[rank {r}] ")]
        want = [f"[rank {r}] line {i} of {r}" for i in range(200)] + [f"[rank {r}] no newline {r}"]
        assert mine == want


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"job_id": "../x"}, "job_id"),
        ({"env": {"RANK": "3"}}, "env"),
        ({"env": {"MLFLOW_TRACKING_URI": "x"}}, "env"),
        ({"extra_env": {"MASTER_PORT": "1"}}, "extra_env"),
        ({"command": "python train.py"}, "command"),
        (
            {"placement": Placement((ReplicaPlacement(5, (0,)),), "node")},
            "placement.replicas[0].node",
        ),
        (
            {"placement": Placement((ReplicaPlacement(0, (4,)),), "node")},
            "placement.replicas[0].gpus",
        ),
        ({"time_limit_s": 0}, "time_limit_s"),
    ],
)
def test_bad_input_names_the_field(
    rt: LocalRuntime, workdir: Path, change: dict[str, Any], field: str
) -> None:
    args: dict[str, Any] = {
        "job_id": "j",
        "attempt": 1,
        "command": ["true"],
        "placement": GANG,
        "cluster": two_nodes(),
        "env": {},
        "workdir": workdir,
    } | change
    with pytest.raises(LaunchError, match="^" + re.escape(field) + ": "):
        rt.launch(**args)
    assert not (rt.root / "j").exists() or not any((rt.root / "j").iterdir())


def test_an_attempt_launches_once(rt: LocalRuntime, workdir: Path) -> None:
    launch = rt.launch("once", 1, ["true"], GANG, two_nodes(), env={}, workdir=workdir)
    with pytest.raises(LaunchError, match=r"launched before.*reattach"):
        rt.launch("once", 1, ["true"], GANG, two_nodes(), env={}, workdir=workdir)
    assert finish(rt, launch).state == "succeeded"


def test_a_missing_program_fails_the_gang_with_127(rt: LocalRuntime, workdir: Path) -> None:
    one = Placement((ReplicaPlacement(0, (0,)),), "gpu_group")
    launch = rt.launch(
        "nope", 1, ["no-such-program-xyz"], one, two_nodes(), env={}, workdir=workdir
    )
    status = finish(rt, launch)
    assert (status.state, status.exit_code) == ("failed", 127)
    assert "cannot start 'no-such-program-xyz'" in status.log_tail[-1]


def _read(path: Path) -> str | None:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    return text if text.strip() else None
