"""The wrapper around one replica's command, and the /proc facts it shares with the runtime.

The launcher (an Airflow worker) may die while replicas run, and a different process polls
them. So each replica runs under this small wrapper, which owns everything a parent would
normally know:

- it detaches (fork, `setsid`, the first process exits at once): the launcher reaps that first
  process immediately, and the wrapper is re-parented to init (or the nearest subreaper), so no
  zombie of ours waits in the launcher for a `wait()` that may never come. The wrapper leads its
  own session and process group, which the command and its children inherit: signalling the
  group reaches the whole tree;
- it writes `rank-N.pid.json` (pid, pgid, start time from /proc, boot id) before starting the
  command: the launcher's handshake, and how a poller tells our process from a recycled pid;
- it forwards the first SIGTERM/SIGINT/SIGHUP it gets to its whole process group once (its own
  copy is dropped by a flag, so the command sees each signal once);
- it enforces the job's time limit (a deadline on the wall clock set at launch) even when no
  poller is alive: SIGTERM to the group, SIGKILL after the grace period;
- when the command exits, it ends whatever the command left behind in the group (as a
  container's end does), then writes the exit code atomically to `rank-N.exit.json`.

Only the standard library is imported here: the wrapper runs as `python -I shim.py`, so that
the job's own PYTHONPATH or virtualenv cannot break it, and it starts fast.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

POLL_S = 0.05  # how often a wait on processes looks at /proc again
SWEEP_GRACE_S = 5.0  # leftovers of a finished command get this long after SIGTERM
RECORD_S = 2.0  # a wrapper's time to record its command's end after a SIGKILL
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def pid_file(attempt_dir: Path, rank: int) -> Path:
    return attempt_dir / f"rank-{rank}.pid.json"


def exit_file(attempt_dir: Path, rank: int) -> Path:
    return attempt_dir / f"rank-{rank}.exit.json"


def log_file(attempt_dir: Path, rank: int) -> Path:
    return attempt_dir / f"rank-{rank}.log"


def write_json_atomic(path: Path, data: Any) -> None:
    """Write then rename, so that a reader sees the whole file or none of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> Any | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def boot_id() -> str:
    """Changes at every boot: start times from before a reboot mean nothing after it."""
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, process group, start time in clock ticks since boot) from /proc, or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[2]), int(fields[19])


def is_ours(pid: int, start_time: int) -> bool:
    """Whether `pid` is still the process that started at `start_time` and has not exited.

    A zombie (Z) or dying (X) process has exited: its exit code is in our file, or lost.
    """
    st = proc_stat(pid)
    return st is not None and st[2] == start_time and st[0] not in "ZX"


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes whose process group is `pgid`."""
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            st = proc_stat(int(entry.name))
            if st is not None and st[1] == pgid and st[0] not in "ZX":
                out.append(int(entry.name))
    return out


def kill_quietly(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def wait_group_empty(pgid: int, deadline: float, *, keep: int | None = None) -> bool:
    """Poll /proc until no process but `keep` is in the group, or the monotonic deadline."""
    while True:
        if not [p for p in group_members(pgid) if p != keep]:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)


def group_is_ours(pgid: int, start_time: int) -> bool:
    """Our wrapper led this group; with it gone, the group's number cannot be reused while any
    member lives, so live members are ours unless a new leader with that pid appeared."""
    leader = proc_stat(pgid)
    return leader is None or leader[0] in "ZX" or leader[2] == start_time


def killpg_quietly(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop_groups(targets: list[tuple[int, int, int]], grace_s: float) -> None:
    """SIGTERM each (wrapper pid, process group, start time), SIGKILL what is left after
    `grace_s`. A live wrapper gets the SIGTERM and forwards it to its group once; a group whose
    wrapper is gone gets it directly. Each wrapper outlives its command's SIGKILL by a moment,
    to record how the command ended."""
    groups: list[tuple[int, int | None]] = []  # (pgid, the wrapper's pid if alive)
    for pid, pgid, start_time in targets:
        if is_ours(pid, start_time):
            kill_quietly(pid, signal.SIGTERM)
            groups.append((pgid, pid))
        elif group_is_ours(pgid, start_time):
            killpg_quietly(pgid, signal.SIGTERM)
            groups.append((pgid, None))
    deadline = time.monotonic() + grace_s
    for pgid, _ in groups:
        wait_group_empty(pgid, deadline)
    for pgid, wrapper in groups:
        for pid in group_members(pgid):
            if pid != wrapper:
                kill_quietly(pid, signal.SIGKILL)
    deadline = time.monotonic() + RECORD_S
    for pgid, _ in groups:
        if not wait_group_empty(pgid, deadline):
            killpg_quietly(pgid, signal.SIGKILL)


class _Wrapper:
    """The detached wrapper's state: its command, the signal it forwarded, the time limit."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.dir = Path(cfg["dir"])
        self.rank = int(cfg["rank"])
        self.command: list[str] = cfg["command"]
        self.deadline: float | None = cfg.get("deadline")  # wall clock (time.time())
        self.grace_s = float(cfg.get("grace_s", 10.0))
        self.pgid = os.getpgid(0)
        self.child: subprocess.Popen[bytes] | None = None
        self.stopped = False  # a stop signal came from outside (the platform or a person)
        self.timed_out = False
        self.forwarded = False
        self.kill_at: float | None = None  # monotonic time to escalate to SIGKILL

    def say(self, message: str) -> None:
        """A line of our own in the replica's log, so that a user sees what the platform did."""
        print(f"[berth] {message}", file=sys.stderr, flush=True)

    def on_signal(self, signum: int, _frame: object) -> None:
        if self.forwarded:  # our own copy of the group signal, or a repeat
            return
        self.stopped = True
        self.terminate(signum)

    def terminate(self, signum: int = signal.SIGTERM) -> None:
        self.forwarded = True
        self.kill_at = time.monotonic() + self.grace_s
        os.killpg(self.pgid, signum)

    def kill_others(self) -> None:
        for pid in group_members(self.pgid):
            if pid != os.getpid():
                kill_quietly(pid, signal.SIGKILL)

    def run(self) -> int:
        for sig in FORWARDED:
            signal.signal(sig, self.on_signal)
        me = proc_stat(os.getpid())
        assert me is not None
        started = {"pid": os.getpid(), "pgid": self.pgid, "start_time": me[2], "boot_id": boot_id()}
        write_json_atomic(pid_file(self.dir, self.rank), started)
        if self.stopped:  # stopped during the handshake: never start the command
            return self.finish(-signal.SIGTERM)
        try:
            # Signals ignored here would stay ignored in the command; none are (Python's own
            # SIGPIPE setting is restored by Popen).
            self.child = subprocess.Popen(self.command, stdin=subprocess.DEVNULL)
        except OSError as e:
            self.say(f"cannot start {self.command[0]!r}: {e.strerror or e}")
            return self.finish(127 if isinstance(e, FileNotFoundError) else 126)
        if self.stopped:  # a signal that came while starting it
            kill_quietly(self.child.pid, signal.SIGTERM)
        code = self.wait_child()
        self.sweep()
        return self.finish(code)

    def wait_child(self) -> int:
        assert self.child is not None
        limit_at = None
        if self.deadline is not None:
            limit_at = time.monotonic() + max(0.0, self.deadline - time.time())
        exited = _exit_waiter(self.child.pid)
        while (code := self.child.poll()) is None:
            # Wake at least every second: a signal handler may have set a new kill time.
            timeouts = [t - time.monotonic() for t in (limit_at, self.kill_at) if t is not None]
            exited(max(0.0, min([1.0, *timeouts])))
            now = time.monotonic()
            if self.kill_at is not None and now >= self.kill_at:
                self.say(f"still running {self.grace_s:g} s after SIGTERM; sending SIGKILL")
                self.kill_others()
                self.kill_at = None
            elif limit_at is not None and now >= limit_at and not self.forwarded:
                self.say("time limit reached; sending SIGTERM to the replica")
                self.timed_out = True
                limit_at = None
                self.terminate()
        return code

    def sweep(self) -> None:
        """End what the command left in the group, so that its GPUs are really free."""
        if not [p for p in group_members(self.pgid) if p != os.getpid()]:
            return
        self.say("the command exited; stopping the processes it left behind")
        self.forwarded = True  # our own SIGTERM to the group is not a stop request
        os.killpg(self.pgid, signal.SIGTERM)
        deadline = time.monotonic() + min(self.grace_s, SWEEP_GRACE_S)
        if not wait_group_empty(self.pgid, deadline, keep=os.getpid()):
            self.kill_others()

    def finish(self, code: int) -> int:
        record = {
            "code": code,
            "signal": -code if code < 0 else None,
            "stopped": self.stopped,
            "timed_out": self.timed_out,
            "finished_at": time.time(),
        }
        write_json_atomic(exit_file(self.dir, self.rank), record)
        return 0


def _exit_waiter(pid: int) -> Callable[[float], None]:
    """A wait for the child's exit with a timeout that sleeps in the kernel (a pidfd), not in
    a polling loop; where pidfds are missing (Linux < 5.3), short sleeps."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return lambda timeout: time.sleep(min(timeout, POLL_S))

    def wait(timeout: float) -> None:
        select.select([fd], [], [], timeout)

    return wait


def main(argv: list[str]) -> int:
    """`shim.py CONFIG_JSON`: detach, then run and watch the command (see the module doc)."""
    cfg = json.loads(argv[1])
    if os.fork() > 0:
        os._exit(0)  # the launcher reaps this first process at once
    os.setsid()
    return _Wrapper(cfg).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
