"""Whether a streaming run's worker still exists, and a step that outlives it.

Dagster's default run launcher cannot tell a run whose process was killed (`dagster dev` stopped
hard, a machine restarted) from a live one: the run stays STARTED, and a sensor that waits for it
would never start its replacement. A streaming run therefore tags itself with the host, process id
and process start time of its worker, and the sensor checks that process when it runs on the same
host. Elsewhere (a Kubernetes run launcher) Dagster's run monitoring does this job.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import dagster as dg

WORKER_TAG = "siphon/worker"
# The process that started a run's worker (`worker_identity`): the code server that launched it.
LAUNCHER_TAG = "siphon/launcher"
IN_PROGRESS = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
               dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING]
SNAPSHOT_RUN_TAG = "siphon/snapshot"  # a run that snapshots block ranges (it holds a pool slot)
# A run that never tagged itself this long after it started lost its worker before the op began.
UNTAGGED_GRACE_SECONDS = 600.0
RUN_RECORDS_PAGE = 500


def all_run_records(instance: dg.DagsterInstance, filters: dg.RunsFilter) -> list[dg.RunRecord]:
    """Every run record `filters` matches, newest first, read a page at a time. A read capped at a
    number of runs would miss the oldest: a streaming run started days ago sits behind every run
    queued since (a backfill of a large table queues a run per partition), and a sensor that
    missed it would start a second run of its tables."""
    records: list[dg.RunRecord] = []
    cursor: str | None = None
    while True:
        page = instance.get_run_records(filters, limit=RUN_RECORDS_PAGE, cursor=cursor)
        records += page
        if len(page) < RUN_RECORDS_PAGE:
            return records
        cursor = page[-1].dagster_run.run_id


def _parent_of(pid: int) -> int | None:
    """The parent of process `pid`, from /proc (None where there is none, or the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def worker_identity(pid: int | None = None) -> str:
    """`host:pid:start` of a process (this one by default); `start` tells a reused pid apart."""
    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}:{pid}:{_start_ticks(pid)}"


def worker_tags() -> dict[str, str]:
    """The tags a run's worker records on its run: itself, and the code server that launched it
    when a process did (not `dagster job execute`, which runs the job in its own process)."""
    tags = {WORKER_TAG: worker_identity()}
    if in_step_process():
        tags[LAUNCHER_TAG] = worker_identity(os.getppid())
    return tags


def replaced_launcher(identity: str, this_pid: int | None = None, parent_pid: int | None = None) -> int | None:
    """The process id `identity` (a run's LAUNCHER_TAG) names when that process still runs and is
    another child of the `dagster code-server start` that serves this one (by default this process
    and its parent): a code server that a reload replaced. It serves nothing any more, and lives on
    only until the runs it launched have ended. None for anything else: this process, a process
    gone, another host's, or a code location not served by `dagster code-server start`."""
    from siphon_dagster.location_reload import serving_code_server

    this_pid = os.getpid() if this_pid is None else this_pid
    parent_pid = os.getppid() if parent_pid is None else parent_pid
    local = _local_worker(identity)
    if local is None or not local[1] or local[0] == this_pid:
        return None
    if _parent_of(local[0]) != parent_pid or serving_code_server(parent_pid) is None:
        return None
    return local[0]


def in_step_process() -> bool:
    """Whether this process was started by another Python process through multiprocessing (a run
    worker the code server launched), which it should not outlive."""
    return multiprocessing.parent_process() is not None


def dead_run_reason(run: dg.DagsterRun, started_at: float | None, now: float) -> str | None:
    """Why an in-progress run has no live worker, or None when it may well have one."""
    tag = run.tags.get(WORKER_TAG)
    if tag is None:
        if run.status == dg.DagsterRunStatus.STARTED and started_at is not None \
                and now - started_at > UNTAGGED_GRACE_SECONDS:
            return f"it has been STARTED for {now - started_at:.0f}s and its worker never reported"
        return None
    local = _local_worker(tag)
    if local is None:
        return None  # another machine's process: not ours to judge
    pid, alive = local
    return None if alive else f"its worker process {pid} on {socket.gethostname()} is gone"


def live_worker_pid(run: dg.DagsterRun) -> int | None:
    """The process id of the run's worker when it still runs on this host, else None (another
    host's worker, an untagged run, or a process that is gone or was replaced)."""
    tag = run.tags.get(WORKER_TAG)
    local = _local_worker(tag) if tag is not None else None
    return local[0] if local is not None and local[1] else None


def is_gone(identity: str) -> bool:
    """Whether the process `worker_identity` named has ended (False for another host's process,
    which is not ours to judge)."""
    local = _local_worker(identity)
    return local is not None and not local[1]


def _local_worker(tag: str) -> tuple[int, bool] | None:
    """(pid, whether that process still runs) for a worker tag of this host; None for another host's."""
    host, pid, start = tag.rsplit(":", 2)
    if host != socket.gethostname():
        return None
    return int(pid), start != "gone" and _start_ticks(int(pid)) == start


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


@contextmanager
def stop_when_orphaned(stop: Callable[[], None], on_orphaned: Callable[[str], None],
                       grace_seconds: float = 60.0, interval_seconds: float = 1.0,
                       linger_seconds: float = 10.0) -> Iterator[None]:
    """Calls `stop` when this process's parent dies, and exits the process if it has not left the
    block `grace_seconds` later; having left it, the process still exits `linger_seconds` later if
    it has not ended by itself (what runs on its way out may wait for its dead parent forever: a
    multiprocessing queue's feeder thread flushing into a pipe, say).

    A step of Dagster's multiprocess executor runs in a child of the run's worker. When the worker
    is killed, Dagster marks the run failed and the sensor starts another, but the child lives on
    and keeps applying the stream beside its replacement. Nothing it has not acked is lost when it
    stops: its unacknowledged messages are redelivered to the replacement.

    The process that started the parent counts too: a code server whose own launcher (`dagster
    dev`, `dagster code-server start`) died lives on to finish its runs, and a streaming run never
    finishes. Its run then holds its tables with nobody to stop it or see it. A parent that had no
    launcher to lose (started by init, a container's first process) is not watched that way.
    """
    parent = os.getppid()
    launcher = _parent_of(parent)
    done = threading.Event()

    def abandoned() -> str | None:
        if os.getppid() != parent:
            return f"the run's worker process {parent} is gone"
        now = _parent_of(parent)
        if launcher is not None and launcher > 1 and now is not None and now != launcher:
            return f"process {launcher}, which started the run's worker {parent}, is gone"
        return None

    def watch() -> None:
        while not done.wait(interval_seconds):
            if (reason := abandoned()) is not None:
                on_orphaned(f"{reason}: stopping after the batch in progress")
                stop()
                if not done.wait(grace_seconds):
                    on_orphaned(f"still running {grace_seconds:.0f}s after that: exiting")
                    os._exit(1)
                # Left in time: the step records its end, then nothing is left for this process to do.
                time.sleep(linger_seconds)
                os._exit(0)

    watcher = threading.Thread(target=watch, name="siphon-orphan-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
