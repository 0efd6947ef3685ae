"""Runs a streaming coroutine so that an interrupt always reaches it.

Dagster terminates a run by sending its process SIGINT, and its handler raises an exception in
whatever frame the main thread is in. Under an event loop that frame is often a task's: when the
task is one nobody awaits (a client library's reader, a progress ticker), asyncio keeps the
exception on the task and the loop runs on, so the run never stops. Here the signal is taken by
the loop instead: it cancels the coroutine, which ends the way an interrupt ends it (batches in
progress are acked or left for the next run), and once the loop is closed the signal is raised
again for the process's own handler, so that Dagster still records the run as interrupted.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# SIGTERM is taken only where a handler was installed for it (Dagster's run worker maps it to
# its interrupt); left at its default, it ends the process, as whoever sent it meant.
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def run_interruptibly(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)`, with SIGINT (and a handled SIGTERM) cancelling `main` wherever the
    main thread is, then raised again for the handler installed before."""
    if threading.current_thread() is not threading.main_thread():
        return asyncio.run(main)  # signals reach the main thread only
    previous = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    taken = [sig for sig, handler in previous.items() if callable(handler)]
    received: list[signal.Signals] = []

    async def interruptible() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None

        def interrupt(sig: signal.Signals) -> None:
            if not received:
                task.cancel()
            received.append(sig)

        for sig in taken:
            loop.add_signal_handler(sig, interrupt, sig)
        return await main

    try:
        with asyncio.Runner() as runner:
            outcome = runner.run(interruptible())
    except asyncio.CancelledError:
        if not received:
            raise
        outcome = None
    finally:
        # Closing the loop reset the signals it took to their defaults: the handlers from before
        # come back.
        for sig in taken:
            signal.signal(sig, previous[sig])
    if received:
        signal.raise_signal(received[0])  # the handler from before raises (Dagster's interrupt)
        raise asyncio.CancelledError(f"interrupted by {received[0].name}")  # a handler that ignores it
    return outcome
