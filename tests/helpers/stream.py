"""Reading back what a producer published: every package of an application's stream, in stream
order, through an ephemeral pull consumer, with sliced events joined and values decoded."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import nats
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from siphon_core import naming
from siphon_core.wire import siphon_pb2 as pb
from siphon_core.wire.packages import ChunkReassembler, decode_package
from siphon_core.wire.tuple_data import Value, decode_tuple


@dataclass(frozen=True)
class StreamEvent:
    """One event as a consumer sees it, with its package's table and column names."""

    table: str  # schema.table
    columns: tuple[str, ...]
    operation: int
    xid: int
    commit_lsn: int
    position: int
    commit_time_us: int
    new: tuple[Value, ...] | None
    old: tuple[Value, ...] | None
    old_is_full: bool
    old_is_key: bool
    stream_sequence: int  # of the (last) message that carried it
    raw: bytes  # the serialized Event, to compare duplicates byte for byte

    @property
    def version(self) -> tuple[int, int]:
        return self.commit_lsn, self.position

    def new_row(self) -> dict[str, Value]:
        assert self.new is not None
        return dict(zip(self.columns, self.new, strict=True))

    def old_row(self) -> dict[str, Value]:
        assert self.old is not None
        return dict(zip(self.columns, self.old, strict=True))


@dataclass(frozen=True)
class StreamPackage:
    package: pb.Package  # whole (slices joined)
    stream_sequence: int
    subject: str
    message_id: str | None
    message_count: int  # JetStream messages it took (more than 1 for a sliced event)


async def _read_messages(url: str, application_identifier: str, subject: str | None,
                         batch: int) -> list[tuple[int, str, bytes, str | None]]:
    stream = naming.stream_name(application_identifier)
    connection = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=2)
    try:
        js = connection.jetstream(timeout=10)
        try:
            info = await js.stream_info(stream)
        except NotFoundError:
            return []
        last = info.state.last_seq
        if not info.state.messages:
            return []
        config = ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL,
                                inactive_threshold=30.0, max_waiting=1)
        # Table subjects only (four tokens): the gap subject carries JSON records, not packages.
        filter_subject = subject or f"{naming.subject_prefix(application_identifier)}.*.*"
        subscription = await js.pull_subscribe(filter_subject, durable=None, stream=stream, config=config)
        messages: list[tuple[int, str, bytes, str | None]] = []
        try:
            while True:
                try:
                    fetched = await subscription.fetch(batch, timeout=2)
                except TimeoutError:
                    break
                for message in fetched:
                    sequence = message.metadata.sequence.stream
                    headers = message.headers or {}
                    messages.append((sequence, message.subject, message.data, headers.get("Nats-Msg-Id")))
                if messages and messages[-1][0] >= last:
                    break
        finally:
            await subscription.unsubscribe()
        return messages
    finally:
        await connection.close()


def read_packages(url: str, application_identifier: str, subject: str | None = None,
                  batch: int = 256) -> list[StreamPackage]:
    """Every package of the application's stream (or of one subject), in stream order."""
    messages = asyncio.run(_read_messages(url, application_identifier, subject, batch))
    joiners: dict[str, ChunkReassembler] = {}
    packages = []
    counts: dict[str, int] = {}
    for sequence, subject_, data, message_id in messages:
        part = decode_package(data, f"stream message {sequence}")
        counts[subject_] = counts.get(subject_, 0) + 1
        whole = joiners.setdefault(subject_, ChunkReassembler()).accept(part)
        if whole is not None:
            packages.append(StreamPackage(whole, sequence, subject_, message_id, counts.pop(subject_)))
    return packages


def events_of(packages: list[StreamPackage], table: str | None = None) -> list[StreamEvent]:
    """The events of the packages (of one `schema.table`), values decoded, in stream order."""
    events = []
    for item in packages:
        package = item.package
        name = f"{package.schema}.{package.table}"
        if table is not None and name != table:
            continue
        columns = tuple(column.name for column in package.columns)
        for event in package.events:
            new = tuple(decode_tuple(event.new_row.tuple)[0]) if event.HasField("new_row") else None
            old = tuple(decode_tuple(event.old_row.tuple)[0]) if event.HasField("old_row") else None
            events.append(StreamEvent(name, columns, event.operation, event.xid, event.commit_lsn, event.position,
                                      event.commit_time_us, new, old, event.old_row_is_full, event.old_row_is_key,
                                      item.stream_sequence, event.SerializeToString()))
    return events


def read_events(url: str, application_identifier: str, table: str | None = None) -> list[StreamEvent]:
    return events_of(read_packages(url, application_identifier), table)


def wait_for_events(url: str, application_identifier: str, done: Callable[[list[StreamEvent]], bool],
                    timeout: float = 30.0, table: str | None = None) -> list[StreamEvent]:
    """Reads the stream until `done(events)` holds; fails with what arrived after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        events = read_events(url, application_identifier, table)
        if done(events):
            return events
        if time.monotonic() > deadline:
            raise AssertionError(f"the stream of {application_identifier} did not reach the expected state within "
                                 f"{timeout:.0f}s; {len(events)} events arrived, the last ones: {events[-3:]}")
        time.sleep(0.3)


def assert_commit_order(events: list[StreamEvent]) -> None:
    """Per table: after dropping repeats of a version already seen, versions never decrease; and
    every repeat of a version carries the same event."""
    seen: dict[tuple[str, tuple[int, int]], bytes] = {}
    last: dict[str, tuple[int, int]] = {}
    for event in events:
        key = (event.table, event.version)
        if key in seen:
            assert seen[key] == event.raw, f"two different events with version {event.version} in {event.table}"
            continue
        seen[key] = event.raw
        previous = last.get(event.table)
        assert previous is None or event.version > previous, (
            f"{event.table}: version {event.version} (stream message {event.stream_sequence}) after {previous}")
        last[event.table] = event.version


def unique_events(events: list[StreamEvent]) -> list[StreamEvent]:
    """First occurrence of every (table, version)."""
    seen: set[tuple[str, tuple[int, int]]] = set()
    kept = []
    for event in events:
        key = (event.table, event.version)
        if key not in seen:
            seen.add(key)
            kept.append(event)
    return kept
