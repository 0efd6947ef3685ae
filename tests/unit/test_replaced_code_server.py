"""A run launched by a code server that a reload replaced is told apart: that server is another
child of the `dagster code-server start` serving this one, still running for its runs' sake."""

from __future__ import annotations

import os
import signal
import time

from siphon_dagster.run_liveness import replaced_launcher, worker_identity
from tests.helpers.processes import alive, code_server_with_children


def test_another_child_of_the_same_code_server_start_is_a_replaced_code_server() -> None:
    with code_server_with_children() as (server, (old, current)):
        assert replaced_launcher(worker_identity(old), this_pid=current, parent_pid=server) == old
        # The code server now serving launched it: nothing to replace.
        assert replaced_launcher(worker_identity(current), this_pid=current, parent_pid=server) is None
        # Seen from a process that `dagster code-server start` does not serve (its parent is another).
        assert replaced_launcher(worker_identity(old), this_pid=current, parent_pid=os.getpid()) is None


def test_a_code_server_not_started_by_code_server_start_is_never_called_replaced() -> None:
    # The daemon and the webserver may each start code servers of their own (a workspace of Python
    # modules): another code server beside this one is not a replaced one there.
    with code_server_with_children(command=("api", "grpc", "--socket", "siphon-test.sock")) as (server, (other, this)):
        assert replaced_launcher(worker_identity(other), this_pid=this, parent_pid=server) is None


def test_a_launcher_gone_or_on_another_host_is_not_a_replaced_code_server() -> None:
    with code_server_with_children() as (server, (old, current)):
        identity = worker_identity(old)
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while alive(old) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert replaced_launcher(identity, this_pid=current, parent_pid=server) is None
        host, pid, start = worker_identity(current).rsplit(":", 2)
        assert replaced_launcher(f"{host}-elsewhere:{pid}:{start}", this_pid=-1, parent_pid=server) is None
