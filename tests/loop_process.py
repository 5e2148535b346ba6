"""One scheduling loop as its own OS process, for the failover tests (tests/test_loop.py).

`python tests/loop_process.py URL TTL_S FOLDER` runs `SchedulingLoop` on the workload's store
(store_workload.py) until killed. When `FOLDER/slow-<its pid>` exists, its next cycle stops
inside the locked commit (after writing `FOLDER/in-commit-<pid>`) and waits there to be killed:
a process that dies mid-cycle, holding the store's lock.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from store_workload import open_store

import berth.store.runner as runner_module
from berth.store.loop import SchedulingLoop


def main(url: str, ttl_s: float, folder: Path) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    real = runner_module.commit
    me = os.getpid()

    def commit(*args, **kwargs):
        if (folder / f"slow-{me}").exists():
            (folder / f"in-commit-{me}").write_text(str(time.time()))
            time.sleep(300)  # killed here, its transaction open
        return real(*args, **kwargs)

    runner_module.commit = commit
    loop = SchedulingLoop(open_store(url), ttl_s=ttl_s, check_s=0.2, holder=f"loop-{me}")
    loop.run()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main(sys.argv[1], float(sys.argv[2]), Path(sys.argv[3]))
