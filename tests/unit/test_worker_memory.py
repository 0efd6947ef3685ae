"""A decode worker's allocator keeps freed memory between tasks and gives it back once idle. Each
case runs in a process of its own: the setting holds for the whole process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROBE = """
import json, resource, sys, time
import numpy as np
from siphon_dagster.streaming import worker_memory

def rss_mb():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20

def faults_of_a_task(retention):
    if retention is not None:
        retention.task_started()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    values = np.empty(64 << 20, np.uint8)
    values.fill(1)  # every page touched, as a task's arrays are
    del values
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    if retention is not None:
        retention.task_ended()
    return faults

retention = worker_memory.retain_between_tasks() if sys.argv[1] == "retained" else None
first, second = faults_of_a_task(retention), faults_of_a_task(retention)
held = rss_mb()
time.sleep(worker_memory.IDLE_SECONDS * 2)
print(json.dumps({"first": first, "second": second, "held_mb": held, "idle_mb": rss_mb(),
                  "same_object": worker_memory.retain_between_tasks() is retention}))
"""


def _probe(mode: str) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_the_next_task_reuses_the_pages_the_last_one_freed_and_an_idle_worker_gives_them_back() -> None:
    pages = (64 << 20) // 4096
    plain = _probe("plain")
    retained = _probe("retained")
    # Page faults alone do not tell (transparent huge pages fault 2 MB at a time when the kernel
    # has them): what the process holds does.
    assert plain["held_mb"] < 40, f"without retention, the freed 64 MB go back at once: {plain}"
    assert retained["held_mb"] > plain["held_mb"] + 50, f"between tasks the freed 64 MB stay: {retained}"
    assert retained["second"] < pages / 10, f"the next task reuses them: {retained}"
    assert retained["idle_mb"] < retained["held_mb"] - 50, f"idle, they go back to the system: {retained}"
    assert retained["same_object"]
