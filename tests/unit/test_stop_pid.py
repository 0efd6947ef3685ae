"""stop_pid stops the whole process group it started, a member started during the shutdown included."""

from __future__ import annotations

import time
from pathlib import Path

from siphon_stack.process import group_members, start_process, stop_pid

# On SIGTERM the leader starts one more process into its group, after the group's signal went, and exits.
STARTS_A_CHILD_ON_THE_WAY_OUT = 'trap "sleep 300 & exit 0" TERM; while :; do sleep 0.05; done'


def test_a_process_started_while_the_group_stops_is_stopped_too(tmp_path: Path) -> None:
    leader = start_process("supervisor", ["sh", "-c", STARTS_A_CHILD_ON_THE_WAY_OUT], tmp_path / "log")
    deadline = time.monotonic() + 10
    while len(group_members(leader.pid)) < 2 and time.monotonic() < deadline:  # the shell and its sleep
        time.sleep(0.05)
    assert leader.pid in group_members(leader.pid)
    stop_pid(leader.pid, timeout=10)
    leader.wait(5)
    assert group_members(leader.pid) == []


def test_a_group_that_stops_whole_is_left_at_once(tmp_path: Path) -> None:
    leader = start_process("sleeper", ["sh", "-c", "sleep 300 & sleep 300"], tmp_path / "log")
    deadline = time.monotonic() + 10
    while len(group_members(leader.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(group_members(leader.pid)) == 3
    started = time.monotonic()
    stop_pid(leader.pid, timeout=10)
    assert time.monotonic() - started < 5
    leader.wait(5)
    assert group_members(leader.pid) == []
