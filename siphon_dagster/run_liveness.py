"""Whether a streaming run's worker still exists.

Dagster's default run launcher cannot tell a run whose process was killed (`dagster dev` stopped
hard, a machine restarted) from a live one: the run stays STARTED, and a sensor that waits for it
would never start its replacement. A streaming run therefore tags itself with the host, process id
and process start time of its worker, and the sensor checks that process when it runs on the same
host. Elsewhere (a Kubernetes run launcher) Dagster's run monitoring does this job.
"""

from __future__ import annotations

import os
import socket

import dagster as dg

WORKER_TAG = "siphon/worker"
# A run that never tagged itself this long after it started lost its worker before the op began.
UNTAGGED_GRACE_SECONDS = 600.0


def worker_identity(pid: int | None = None) -> str:
    """`host:pid:start` of a process (this one by default); `start` tells a reused pid apart."""
    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}:{pid}:{_start_ticks(pid)}"


def dead_run_reason(run: dg.DagsterRun, started_at: float | None, now: float) -> str | None:
    """Why an in-progress run has no live worker, or None when it may well have one."""
    tag = run.tags.get(WORKER_TAG)
    if tag is None:
        if run.status == dg.DagsterRunStatus.STARTED and started_at is not None \
                and now - started_at > UNTAGGED_GRACE_SECONDS:
            return f"it has been STARTED for {now - started_at:.0f}s and its worker never reported"
        return None
    host, pid, start = tag.rsplit(":", 2)
    if host != socket.gethostname():
        return None  # another machine's process: not ours to judge
    if _start_ticks(int(pid)) != start:
        return f"its worker process {pid} on {host} is gone"
    return None


def _start_ticks(pid: int) -> str:
    """The process's start time in clock ticks since boot, or 'gone'."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(") ", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return "gone"
    if fields[0] == "Z":
        return "gone"
    return fields[19]  # field 22 of proc(5), counted after the command name
