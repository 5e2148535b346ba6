"""The embedded default runtime: every replica of a gang as a local process on this machine.

Every declared node runs on localhost (a cluster YAML may declare several, e.g. to try gangs on
a laptop), so the whole gang meets at 127.0.0.1 on a port chosen at launch.

What the runtime keeps for one attempt lives in `root/<job_id>/attempt-<n>/`; the job's
checkpoints, shared by its attempts, in `root/<job_id>/checkpoints/` (`BERTH_CHECKPOINT_DIR`):

- `manifest.json`: the launch handle (`LocalLaunch`), written before any replica starts and
  again with the pids once all have started; `reattach` reads only this and the files below;
- `rank-N.log`: the replica's stdout and stderr;
- `rank-N.pid.json` and `rank-N.exit.json`: written by each replica's wrapper (`shim.py`);
- `failure.json`: the gang's first failure, once seen, so that every later poll tells the same
  story; `stopped.json`: a stop was requested.

Time limits are enforced by each replica's wrapper, against a deadline fixed at launch, so they
hold while no poller runs; `GangStatus.started_at` and `time_limit_s` let a poller show them.
Linux only: processes are found again through /proc.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from berth.runtime import shim
from berth.runtime.base import (
    CHECKPOINT_DIR,
    RUNTIME_ENV,
    GangStatus,
    LaunchError,
    LogCursor,
    ReplicaHandle,
    ReplicaStatus,
    check_launch,
    first_failure,
    own_launch,
    replica_env,
    replica_handles,
)
from berth.runtime.base import Launch as _Launch
from berth.runtime.inventory import DEVICES_LABEL, InventoryError, detect_mig
from berth.runtime.mig_devices import mig_uuid
from scheduling.cluster import Cluster
from scheduling.jobs import Placement, ReplicaPlacement

MASTER_ADDR = "127.0.0.1"
LOG_TAIL_LINES = 20
LOG_CHUNK = 1 << 20  # bytes read per replica per `logs` call, so one call stays bounded
# The launcher's own settings, secrets included (Airflow's database and connections), are no
# business of a job's.
_NOT_INHERITED = ("AIRFLOW",)


class LocalReplica(ReplicaHandle):
    """A replica as a local process: its wrapper's pid, process group and /proc start time."""

    log: str
    pid: int | None = None  # None until the wrapper reports (see `reattach`)
    pgid: int | None = None
    start_time: int | None = None


class LocalLaunch(_Launch):
    runtime: Literal["local"] = "local"
    dir: str  # the attempt's directory: manifest, logs, pid and exit files
    workdir: str
    command: tuple[str, ...]
    boot_id: str  # pids and start times mean nothing after a reboot
    replicas: tuple[LocalReplica, ...]


def device_indices(cluster: Cluster, rep: ReplicaHandle | ReplicaPlacement) -> str:
    """The replica's GPUs as this machine numbers them: the engine's indices on its node,
    through the node's `DEVICES_LABEL` where it has one (a machine of several GPU models is a
    node per model, each numbered from 0)."""
    mapped = cluster.nodes[rep.node].labels.get(DEVICES_LABEL)
    if mapped is None:
        return ",".join(map(str, rep.gpus))
    devices = mapped.split(",")
    return ",".join(devices[g] for g in rep.gpus)


class LocalRuntime:
    """Runs gangs as local process groups under `root`; see the module docstring."""

    def __init__(
        self,
        root: Path,
        *,
        grace_s: float = 10.0,
        start_timeout_s: float = 30.0,
        inherit_env: bool = True,
        nvidia_smi: str = "nvidia-smi",
    ) -> None:
        self.root = Path(root)
        self.grace_s = grace_s  # for the replicas stopped when a gang fails, and time limits
        self.start_timeout_s = start_timeout_s
        self.inherit_env = inherit_env  # the launcher's environment, less Airflow's own
        self.nvidia_smi = nvidia_smi  # read for MIG instances' UUIDs (`mig_devices.py`)

    # ---- launch -------------------------------------------------------------------------

    def launch(
        self,
        job_id: str,
        attempt: int,
        command: Sequence[str],
        placement: Placement,
        cluster: Cluster,
        *,
        env: Mapping[str, str],
        workdir: Path,
        extra_env: Mapping[str, str] | None = None,
        time_limit_s: float | None = None,
    ) -> LocalLaunch:
        """Start every replica under its wrapper and wait until each has reported its pid.

        `env` is the job's (JobSpec.env); `extra_env` is the platform's (e.g. MLflow's run id).
        Raises LaunchError for bad input, an attempt launched before, or a replica that did
        not start; in the last case the replicas that did start are stopped first.
        """
        check_launch(job_id, attempt, command, placement, cluster, env, extra_env, time_limit_s)
        # What each replica sees as its GPUs, worked out before anything starts. A MIG
        # instance is seen by its UUID only, read from nvidia-smi once per launch that has any.
        listing = None
        if any(r.instance >= 0 for r in placement.replicas):
            listing = detect_mig(self.nvidia_smi)
        try:
            seen = [
                mig_uuid(cluster, r.node, r.instance, listing)
                if r.instance >= 0
                else device_indices(cluster, r)
                for r in placement.replicas
            ]
        except InventoryError as e:
            raise LaunchError(f"placement: {e}") from None
        attempt_dir = self.attempt_dir(job_id, attempt)
        attempt_dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            attempt_dir.mkdir()  # atomic: two launchers of one attempt cannot both pass
        except FileExistsError:
            raise LaunchError(
                f"job {job_id!r} attempt {attempt} was launched before ({attempt_dir}); "
                "reattach(job_id, attempt) to follow it, or launch a new attempt number"
            ) from None
        workdir = Path(workdir).resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        replicas = replica_handles(
            LocalReplica,
            placement,
            cluster,
            log=lambda rank: str(shim.log_file(attempt_dir, rank)),
        )
        launch = LocalLaunch(
            job_id=job_id,
            attempt=attempt,
            launched_at=time.time(),
            time_limit_s=time_limit_s,
            master_addr=MASTER_ADDR,
            master_port=_free_port(),
            dir=str(attempt_dir),
            workdir=str(workdir),
            command=tuple(command),
            boot_id=shim.boot_id(),
            replicas=replicas,
        )
        _write_manifest(launch)
        checkpoints = self.checkpoint_dir(job_id)
        checkpoints.mkdir(exist_ok=True)
        base = self._base_env() | dict(env) | dict(extra_env or {})
        base[CHECKPOINT_DIR] = str(checkpoints)
        try:
            for rep in replicas:
                devices = {"CUDA_VISIBLE_DEVICES": seen[rep.rank]}
                self._spawn(launch, rep, base | replica_env(launch, rep) | devices)
        except BaseException:
            self._terminate(self._with_pids(launch), self.grace_s)  # no partial gangs
            raise
        launch = self._await_started(launch)
        _write_manifest(launch)
        return launch

    def attempt_dir(self, job_id: str, attempt: int) -> Path:
        return self.root / job_id / f"attempt-{attempt}"

    def checkpoint_dir(self, job_id: str) -> Path:
        """The job's checkpoints (BERTH_CHECKPOINT_DIR): shared by all its attempts."""
        return self.root / job_id / "checkpoints"

    def _base_env(self) -> dict[str, str]:
        if not self.inherit_env:
            return {"PATH": os.environ.get("PATH", os.defpath)}
        return {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(_NOT_INHERITED) and k not in RUNTIME_ENV
        }

    def _spawn(self, launch: LocalLaunch, rep: LocalReplica, env: dict[str, str]) -> None:
        deadline = None if launch.time_limit_s is None else launch.launched_at + launch.time_limit_s
        cfg = {
            "dir": launch.dir,
            "rank": rep.rank,
            "command": list(launch.command),
            "deadline": deadline,
            "grace_s": self.grace_s,
        }
        with open(rep.log, "ab") as log:
            # -I: the job's PYTHONPATH or PYTHONHOME must not break the wrapper (stdlib only).
            first = subprocess.Popen(
                [sys.executable, "-I", shim.__file__, json.dumps(cfg)],
                cwd=launch.workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        # The wrapper forks and this first process exits at once: reaping it here leaves no
        # zombie behind however long this launcher lives (see shim.py).
        if first.wait(timeout=self.start_timeout_s) != 0:
            raise LaunchError(f"the wrapper of rank {rep.rank} failed to start; see {rep.log}")

    def _await_started(self, launch: LocalLaunch) -> LocalLaunch:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            launch = self._with_pids(launch)
            if all(r.pid is not None for r in launch.replicas):
                return launch
            if time.monotonic() >= deadline:
                late = [r.rank for r in launch.replicas if r.pid is None]
                self._terminate(launch, self.grace_s)
                raise LaunchError(
                    f"rank(s) {late} did not start within {self.start_timeout_s:g} s (the machine "
                    f"may be overloaded); the others were stopped; see the logs in {launch.dir}"
                )
            time.sleep(shim.POLL_S)

    @staticmethod
    def _with_pids(launch: LocalLaunch) -> LocalLaunch:
        replicas = tuple(_with_pid(Path(launch.dir), r) for r in launch.replicas)
        return launch.model_copy(update={"replicas": replicas})

    # ---- follow -------------------------------------------------------------------------

    def reattach(self, job_id: str, attempt: int, *, team: str | None = None) -> LocalLaunch | None:
        """The handle from the attempt's manifest on disk; None if never launched here.
        `team` is not needed: an attempt's folder is named by job and attempt alone."""
        data = shim.read_json(self.attempt_dir(job_id, attempt) / "manifest.json")
        if data is None:
            return None
        # A launcher that died mid-launch left pids out of the manifest: the wrappers' files
        # have them.
        return self._with_pids(LocalLaunch.from_dict(data))

    def launch_from_dict(self, data: Mapping[str, Any]) -> LocalLaunch:
        return LocalLaunch.from_dict(data)

    def poll(self, launch: _Launch) -> GangStatus:
        """The gang's state. On its first failure (a non-zero exit or a lost replica), the
        failure is recorded and the other replicas are stopped (within `grace_s`) before this
        returns: a gang is all or nothing."""
        launch = _local(launch)
        here = Path(launch.dir)
        statuses = [_replica_status(launch, r) for r in launch.replicas]
        failure = shim.read_json(here / "failure.json")
        if failure is None and not (here / "stopped.json").exists():
            failure = _failure_record(launch, statuses)
            if failure is not None:
                shim.write_json_atomic(here / "failure.json", failure)
        if failure is not None and any(s.state == "running" for s in statuses):
            self._terminate(launch, self.grace_s)
            statuses = [_replica_status(launch, r) for r in launch.replicas]
        common = {
            "replicas": tuple(statuses),
            "started_at": launch.launched_at,
            "time_limit_s": launch.time_limit_s,
        }
        if failure is not None:
            return GangStatus(state="failed", **common, **failure)
        if any(s.state == "running" for s in statuses):
            return GangStatus(state="running", **common)
        if (here / "stopped.json").exists():
            return GangStatus(state="stopped", **common, message="stopped on request")
        return GangStatus(state="succeeded", **common)

    def stop(self, launch: _Launch, grace_s: float = 10.0) -> None:
        """SIGTERM every replica's process group, SIGKILL what remains after `grace_s`.

        Idempotent, and safe when the processes are gone. A later `poll` says `stopped`
        unless the gang had failed before.
        """
        launch = _local(launch)
        marker = Path(launch.dir) / "stopped.json"
        if not marker.exists():
            shim.write_json_atomic(marker, {"at": time.time()})
        self._terminate(launch, grace_s)

    def _terminate(self, launch: LocalLaunch, grace_s: float) -> None:
        if launch.boot_id != shim.boot_id():
            return  # the machine rebooted: none of these processes exist any more
        reps = self._with_pids(launch).replicas
        shim.stop_groups(
            [(r.pid, r.pgid, r.start_time) for r in reps if r.pid and r.pgid and r.start_time],
            grace_s,
        )

    def logs(self, launch: _Launch, cursor: LogCursor | None = None) -> tuple[list[str], LogCursor]:
        """Complete new lines of every replica's log since `cursor`, as `[rank N] line`.

        A line still being written is held back until its newline comes, or until the
        replica has ended; a line longer than 1 MiB comes in pieces.
        """
        launch = _local(launch)
        offsets = dict(cursor.offsets) if cursor else {}
        out: list[str] = []
        for rep in launch.replicas:
            # Decided before reading: once a replica has ended, what we read is all there is.
            ended = _replica_status(launch, rep).state != "running"
            start = offsets.get(rep.rank, 0)
            try:
                with open(rep.log, "rb") as f:
                    f.seek(start)
                    chunk = f.read(LOG_CHUNK)
            except FileNotFoundError:
                continue
            cut = chunk.rfind(b"\n") + 1
            if len(chunk) == LOG_CHUNK and cut == 0:
                cut = len(chunk)  # one huge line: let it through in pieces
            elif ended and len(chunk) < LOG_CHUNK:
                cut = len(chunk)  # the replica's last words, with or without a newline
            if cut == 0:
                continue
            offsets[rep.rank] = start + cut
            text = chunk[:cut].decode("utf-8", errors="replace")
            out += [f"[rank {rep.rank}] {line.rstrip(chr(13))}" for line in _lines(text)]
        return out, LogCursor(offsets=offsets)


# ---- helpers ----------------------------------------------------------------------------


def _free_port() -> int:
    """A port free now; the gang binds it moments later (as torchrun does for a standalone
    rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((MASTER_ADDR, 0))
        return int(s.getsockname()[1])


def _write_manifest(launch: LocalLaunch) -> None:
    shim.write_json_atomic(Path(launch.dir) / "manifest.json", launch.to_dict())


def _local(launch: _Launch) -> LocalLaunch:
    return own_launch(launch, LocalLaunch, "local")


def _with_pid(attempt_dir: Path, rep: LocalReplica) -> LocalReplica:
    if rep.pid is not None:
        return rep
    started = shim.read_json(shim.pid_file(attempt_dir, rep.rank))
    if started is None:
        return rep
    return rep.model_copy(
        update={k: started[k] for k in ("pid", "pgid", "start_time")},
    )


def _replica_status(launch: LocalLaunch, rep: LocalReplica) -> ReplicaStatus:
    here = Path(launch.dir)
    rep = _with_pid(here, rep)
    base = {"rank": rep.rank, "node_name": rep.node_name}
    for look in range(2):
        done = shim.read_json(shim.exit_file(here, rep.rank))
        if done is not None:
            return ReplicaStatus(
                **base,
                state="exited",
                exit_code=done["code"],
                signal=done["signal"],
                stopped=done["stopped"],
                timed_out=done["timed_out"],
                finished_at=done["finished_at"],
            )
        # The wrapper may write its file and exit between the two looks: look again.
        if look == 0 and (
            rep.pid is not None
            and rep.start_time is not None
            and launch.boot_id == shim.boot_id()
            and shim.is_ours(rep.pid, rep.start_time)
        ):
            return ReplicaStatus(**base, state="running")
    return ReplicaStatus(**base, state="lost")


def _failure_record(launch: LocalLaunch, statuses: list[ReplicaStatus]) -> dict[str, Any] | None:
    found = first_failure(statuses, launch.time_limit_s)
    if found is None:
        return None
    first, reason, message = found
    return {
        "failed_rank": first.rank,
        "exit_code": first.exit_code,
        "reason": reason,
        "log_tail": _tail(Path(launch.replicas[first.rank].log), LOG_TAIL_LINES),
        "message": message,
    }


def _tail(path: Path, n: int) -> tuple[str, ...]:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ()
    return tuple(_lines(text)[-n:])


def _lines(text: str) -> list[str]:
    lines = text.split("\n")
    return lines[:-1] if lines and lines[-1] == "" else lines
