"""A Spark Python worker keeps the memory its last task freed for its next task, and gives it back
once idle.

A decode task allocates its large arrays (the gathered rows, the value columns: tens of MB each)
through the C library's `malloc`. With its default settings the heap's top is handed back to the
system whenever a task frees it, or such sizes are mapped afresh, and every page is faulted in and
zeroed by the kernel again in the next task: on 115,000 notes-shaped events a task spent 96 - 110
of its 390 - 400 ms in the kernel (over 2,000 `brk` calls). Here large allocations come from the
heap and what a task frees stays there while tasks follow each other, so the next task reuses its
pages (30 ms in the kernel). A thread hands the heap's free pages back to the system once the
worker has run no task for `IDLE_SECONDS`, so an idle worker holds no more than before.

glibc only (`mallopt`, `malloc_trim`); elsewhere nothing changes.
"""

from __future__ import annotations

import ctypes
import threading
import time

IDLE_SECONDS = 2.0
# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
# free() trims the heap's top only past this (mallopt takes an int): the idle thread trims instead.
_KEEP_FREED_BYTES = 2**31 - 1


class Retention:
    """Tells the idle thread when tasks run."""

    def __init__(self, trim: ctypes._CFuncPtr) -> None:
        self._trim = trim
        self._lock = threading.Lock()
        self._running = 0
        self._last_end = time.monotonic()
        self._trimmed = True
        threading.Thread(target=self._trim_when_idle, name="siphon-memory-trim", daemon=True).start()

    def task_started(self) -> None:
        with self._lock:
            self._running += 1
            self._trimmed = False

    def task_ended(self) -> None:
        with self._lock:
            self._running -= 1
            self._last_end = time.monotonic()

    def _trim_when_idle(self) -> None:
        while True:
            time.sleep(IDLE_SECONDS / 2)
            with self._lock:
                idle = not self._running and not self._trimmed and time.monotonic() - self._last_end >= IDLE_SECONDS
                if idle:
                    self._trimmed = True
            if idle:
                self._trim(0)


_retention: Retention | None = None
_unavailable = False


def retain_between_tasks() -> Retention | None:
    """Sets this process's allocator up (the first call); the retention to tell of each task, or
    None where the C library has no `mallopt`."""
    global _retention, _unavailable
    if _retention is not None or _unavailable:
        return _retention
    try:
        libc = ctypes.CDLL(None)
        mallopt, trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        _unavailable = True
        return None
    mallopt.argtypes, trim.argtypes = [ctypes.c_int, ctypes.c_int], [ctypes.c_size_t]
    if not (mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, _KEEP_FREED_BYTES)):
        _unavailable = True
        return None
    _retention = Retention(trim)
    return _retention
