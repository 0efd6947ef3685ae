"""Processes of a test, as /proc shows them."""

from __future__ import annotations


def alive(pid: int) -> bool:
    """The process exists and has not exited (a zombie waiting for its parent counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(") ", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
