"""Has a table's stream applied, at one target, everything the source committed before an LSN?

(a) The producer's slot confirmed a position at or past the LSN: every change before it is stored in
JetStream. (b) The target's durable consumer acked the subject's last message as it was then. Both
are waited for, up to a timeout; the caller decides what not keeping up means.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from siphon_core import naming, queue
from siphon_dagster import source
from siphon_dagster.streaming.interrupts import run_interruptibly


@dataclass(frozen=True)
class StreamWatch:
    """What to watch for one (target, table)."""

    source_dsn: str
    slot: str
    subject: str
    consumer: str
    make_queue: object  # () -> JetStreamQueue, not connected


@dataclass(frozen=True)
class StreamWait:
    caught_up: bool
    seconds: float
    detail: str  # what was reached, or what was still missing at the timeout


def slot_confirmed_lsn(dsn: str, slot: str) -> int | None:
    with source.connect(dsn, autocommit=True) as connection:
        row = connection.execute("select confirmed_flush_lsn::text from pg_replication_slots where slot_name = %s",
                                 (slot,)).fetchone()
    return naming.parse_lsn(row[0]) if row and row[0] else None


def wait_until_applied(watch: StreamWatch, lsn: int, timeout: float, interval: float = 0.3) -> StreamWait:
    started = time.monotonic()
    deadline = started + timeout
    wanted = naming.format_lsn(lsn)
    while True:
        confirmed = slot_confirmed_lsn(watch.source_dsn, watch.slot)
        if confirmed is not None and confirmed >= lsn:
            break
        if time.monotonic() >= deadline:
            where = "does not exist" if confirmed is None else f"confirmed {naming.format_lsn(confirmed)}"
            return StreamWait(False, time.monotonic() - started,
                              f"the producer has not stored every change before {wanted} in the queue within "
                              f"{timeout:.0f}s (slot {watch.slot} {where}): is siphon-producer running?")
        time.sleep(interval)
    # A check run terminated while it waits stops waiting (see streaming/interrupts.py).
    return run_interruptibly(_wait_for_consumer(watch, wanted, started, deadline, interval))


async def _wait_for_consumer(watch: StreamWatch, wanted: str, started: float, deadline: float,
                             interval: float) -> StreamWait:
    jetstream = watch.make_queue()  # type: ignore[operator]
    await queue.connect_within(jetstream)
    try:
        last = await queue.last_sequence(jetstream, watch.subject)
        while True:
            position = await queue.consumer_position(jetstream, watch.consumer)
            if last == 0 or (position is not None and position.ack_floor >= last):
                return StreamWait(True, time.monotonic() - started,
                                  f"applied past {wanted} (stream sequence {last} acked)")
            if time.monotonic() >= deadline:
                floor = "no consumer (never streamed)" if position is None else f"acked up to {position.ack_floor}"
                return StreamWait(False, time.monotonic() - started,
                                  f"the stream is not keeping up: changes before {wanted} end at stream sequence "
                                  f"{last}, consumer {watch.consumer} {floor} after {deadline - started:.0f}s")
            await asyncio.sleep(interval)
    finally:
        await jetstream.close()
