"""Processes of a test, as /proc shows them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager


def _state_and_parent(pid: int) -> tuple[str, int] | None:
    """The process's state letter and its parent's pid; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state, parent = stat.read().rsplit(") ", 1)[1].split()[:2]
    except (FileNotFoundError, ProcessLookupError):
        return None
    return state, int(parent)


def alive(pid: int) -> bool:
    """The process exists and has not exited (a zombie waiting for its parent counts as gone)."""
    status = _state_and_parent(pid)
    return status is not None and status[0] != "Z"


def children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of each live process whose parent is `pid`."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        status = _state_and_parent(int(entry))
        if status is None or status[1] != pid or status[0] == "Z":
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                found.append((int(entry), cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip()))
        except (FileNotFoundError, ProcessLookupError):
            continue  # gone meanwhile
    return found


# A stand-in for `dagster code-server start`, as its command line reads, that starts children
# which stand in for the code servers it serves (one current, the others replaced by reloads).
_CODE_SERVER = """
import subprocess, sys, time
children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for _ in range(int(sys.argv[1]))]
print(" ".join(str(child.pid) for child in children), flush=True)
time.sleep(120)
"""


@contextmanager
def code_server_with_children(children: int = 2, command: tuple[str, ...] = ("code-server", "start", "--socket",
                                                                               "siphon-test.sock")) -> Iterator[tuple[int, list[int]]]:
    """(the stand-in's pid, its children's pids); every process is killed on the way out."""
    server = subprocess.Popen([sys.executable, "-c", _CODE_SERVER, str(children), *command], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert server.stdout is not None
        pids = [int(pid) for pid in server.stdout.readline().split()]
        try:
            yield server.pid, pids
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    finally:
        server.kill()
        server.wait()
