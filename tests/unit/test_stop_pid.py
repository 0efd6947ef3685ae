"""stop_pid stops the whole process group it started, a member started during the shutdown included."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from siphon_stack.process import STOP_SIGNALS, group_members, start_process, stop_pid

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


def _signal_bits(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1], 16)
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _has(bits: int, sig: signal.Signals) -> bool:
    return bool(bits >> (sig - 1) & 1)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads signal masks from /proc")
def test_a_starter_that_ignores_or_blocks_stop_signals_does_not_pass_that_on(tmp_path: Path) -> None:
    # As under a shell that started the starter in the background, with Dagster's SIGTERM mapping.
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS}
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGHUP])
    try:
        sleeper = start_process("sleeper", ["sleep", "300"], tmp_path / "log")
        group = start_process("sleepers", ["sh", "-c", "sleep 300 & sleep 300"], tmp_path / "log")
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGHUP])
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    try:
        for field in ("SigIgn", "SigBlk"):  # sleep changes neither
            bits = _signal_bits(sleeper.pid, field)
            assert not any(_has(bits, sig) for sig in (*STOP_SIGNALS, signal.SIGHUP)), (field, hex(bits))
        deadline = time.monotonic() + 10
        while len(group_members(group.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        started = time.monotonic()
        stop_pid(group.pid, timeout=10)
        assert time.monotonic() - started < 5  # stopped by SIGTERM, not by the SIGKILL at the timeout
    finally:
        for process in (sleeper, group):
            stop_pid(process.pid, timeout=1)
            process.wait(5)
    assert group_members(group.pid) == []
