"""A launcher that dies mid-launch, as a triggerer killed by the OOM killer or a node's loss
would: `python tests/dying_launcher.py JOB_ID AFTER` runs one cycle of the store named by the
environment's Berth settings and launches the admitted job as the admission trigger does
(`launch_attempt`), but SIGKILLs its own process right after the API server accepted the
attempt's Service (AFTER = "service") or rank 0's pod (AFTER = "pod"; the other ranks' pods,
created side by side, are held back until the kill). Nothing is cleaned
up, nothing is marked: what is left is what a real kill leaves. Exits 3 if the job was not
admitted (the test's setup is wrong)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

from kubernetes import client

from berth.settings import settings
from operators.launching import LaunchPlan, launch_attempt
from operators.tracking import TaskRef


def die_after(method: str) -> None:
    real = getattr(client.CoreV1Api, method)

    def create_then_die(self: client.CoreV1Api, *args: Any, **kwargs: Any) -> Any:
        body = args[1] if len(args) > 1 else kwargs["body"]
        if method == "create_namespaced_pod" and not body["metadata"]["name"].endswith("-0"):
            threading.Event().wait()  # the other ranks (created side by side) wait for the kill
        real(self, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    setattr(client.CoreV1Api, method, create_then_die)


def main(job_id: str, after: str) -> int:
    die_after({"service": "create_namespaced_service", "pod": "create_namespaced_pod"}[after])
    store = settings().store()
    store.schedule()
    st = store.status(job_id)
    if st.state != "admitted":
        print(f"{job_id} is {st.state}, not admitted: {st.message}", file=sys.stderr)
        return 3
    plan = LaunchPlan(st.spec.model_dump(mode="json"), {}, TaskRef("d", "r", "t", 1))
    launch_attempt(plan, job_id, st.attempt)
    print("the launch ended without the kill", file=sys.stderr)
    return 4


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
