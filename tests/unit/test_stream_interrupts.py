"""An interrupt reaches a streaming run wherever its event loop is when the signal comes."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
from dagster._core.errors import DagsterExecutionInterruptedError
from dagster._utils.interrupts import raise_interrupts_as

from siphon_dagster.streaming.interrupts import run_interruptibly

RUN_AT_MOST_SECONDS = 20.0


@pytest.fixture(autouse=True)
def python_signal_defaults():
    """Each test starts from Python's own handlers (other tests' Dagster contexts change them)."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


async def _busy_unawaited_task() -> None:
    """Like a client library's reader task: it computes most of the time and nobody awaits it,
    so an exception raised in its frame by a signal handler is kept on the task, unseen."""
    while True:
        started = time.perf_counter()
        while time.perf_counter() - started < 0.05:
            pass
        await asyncio.sleep(0)


class _Run:
    def __init__(self) -> None:
        self.cancelled = False
        self.signals_during_run: dict[int, object] = {}

    async def main(self) -> str:
        self.signals_during_run = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        background = asyncio.create_task(_busy_unawaited_task())
        try:
            deadline = time.monotonic() + RUN_AT_MOST_SECONDS
            while time.monotonic() < deadline:
                await asyncio.sleep(0.001)
            return "ran to its end"
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        finally:
            background.cancel()


def _interrupt_soon(sig: signal.Signals = signal.SIGINT) -> threading.Timer:
    timer = threading.Timer(0.5, os.kill, (os.getpid(), sig))
    timer.start()
    return timer


def test_dagsters_interrupt_ends_the_run_even_when_it_lands_in_a_task_nobody_awaits() -> None:
    run = _Run()
    with raise_interrupts_as(DagsterExecutionInterruptedError):
        dagster_handler = signal.getsignal(signal.SIGINT)
        _interrupt_soon()
        with pytest.raises(DagsterExecutionInterruptedError):
            run_interruptibly(run.main())
        # Dagster's handler is back for what follows the run (its own clean-up).
        assert signal.getsignal(signal.SIGINT) is dagster_handler
    assert run.cancelled, "the run's coroutine did not see the interrupt"


def test_a_sigterm_mapped_to_the_interrupt_ends_the_run_too() -> None:
    run = _Run()
    with raise_interrupts_as(DagsterExecutionInterruptedError):  # it maps SIGTERM to its interrupt
        _interrupt_soon(signal.SIGTERM)
        with pytest.raises(DagsterExecutionInterruptedError):
            run_interruptibly(run.main())
    assert run.cancelled


def test_without_dagster_an_interrupt_is_a_keyboard_interrupt_and_sigterm_keeps_its_default() -> None:
    run = _Run()
    _interrupt_soon()
    with pytest.raises(KeyboardInterrupt):
        run_interruptibly(run.main())
    assert run.cancelled
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    # A SIGTERM nobody handles still ends the process: the run does not take it.
    assert run.signals_during_run[signal.SIGTERM] == signal.SIG_DFL


def test_a_run_that_is_not_interrupted_returns_its_result_and_leaves_the_handlers_as_they_were() -> None:
    async def quick() -> int:
        await asyncio.sleep(0)
        return 7

    with raise_interrupts_as(DagsterExecutionInterruptedError):
        dagster_handler = signal.getsignal(signal.SIGINT)
        assert run_interruptibly(quick()) == 7
        assert signal.getsignal(signal.SIGINT) is dagster_handler


def test_an_error_of_the_run_is_raised_as_it_is() -> None:
    async def failing() -> None:
        raise ValueError("the target refused the batch")

    with pytest.raises(ValueError, match="refused"):
        run_interruptibly(failing())
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
