"""The events of a serialized Package as columns, read by a compiled loop (numba).

Reading a field of an event through the generated protobuf classes costs a Python object and an
attribute lookup, about a microsecond per event once every field a consumer needs is read; a
micro-batch has hundreds of thousands of events. The loop here walks the protobuf wire format of
`Package.events` (field numbers from proto/siphon.proto) and returns every event's operation,
commit LSN, position, commit time and where its row tuples lie in the serialized bytes, without
an object per event.

The generated classes stay the reference: the package is still parsed by them (its column list,
chunk and encoding are read from there), and `read_events` returns None for anything the loop
does not read as they would (a wire type it does not expect, truncated data), so the caller falls
back to them. `tests/unit/test_event_columns.py` holds the two readers to the same answers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import pyarrow as pa

from siphon_core.wire import fields
from siphon_core.wire import siphon_pb2 as pb
from siphon_core.wire.byte_copy import copy_bytes
from siphon_core.wire.packages import parse_package

# A summary counts operations 0..14 by value; slot 15 holds every other value.
_OPERATION_SLOTS = 16
UNKNOWN_OPERATION = -1  # the key of those in PackageSummary.operation_counts
# Slots of a summary's figures.
_FIGURES = 9
_COUNT, _FIRST_LSN, _LAST_LSN, _FIRST_TIME, _LAST_TIME, _HAS_TRUNCATE, _TRUNCATE_LSN, _TRUNCATE_POSITION = range(8)
# Field numbers of proto/siphon.proto, from the generated descriptors (the compiled walks read them
# as constants).
_PACKAGE_EVENTS = fields.PACKAGE_EVENTS
_EVENT_OPERATION, _EVENT_COMMIT_LSN = fields.EVENT_OPERATION, fields.EVENT_COMMIT_LSN
_EVENT_POSITION, _EVENT_COMMIT_TIME = fields.EVENT_POSITION, fields.EVENT_COMMIT_TIME
_EVENT_NEW_ROW, _EVENT_OLD_ROW = fields.EVENT_NEW_ROW, fields.EVENT_OLD_ROW
_EVENT_OLD_IS_FULL, _EVENT_OLD_IS_KEY = fields.EVENT_OLD_IS_FULL, fields.EVENT_OLD_IS_KEY
_ROW_TUPLE = fields.ROW_TUPLE
_EVENT_FIRST_FIELD, _EVENT_LAST_FIELD = fields.EVENT_FIELD_RANGE
_INT32_MAX = int(np.iinfo(np.int32).max)  # read once: np.iinfo costs tens of microseconds a call


@dataclass(frozen=True)
class EventColumns:
    """One entry per event of the package, in order."""

    data: np.ndarray  # the serialized package, uint8
    operations: np.ndarray  # int64, pb.Operation values
    commit_lsns: np.ndarray  # uint64
    positions: np.ndarray  # int64
    commit_times_us: np.ndarray  # int64
    has_new_row: np.ndarray  # bool: the event has a new_row
    new_starts: np.ndarray  # int64: where new_row.tuple's bytes start (its length below)
    new_lengths: np.ndarray  # int64 (0 when there is no tuple)
    has_old_row: np.ndarray  # bool: the event has an old_row
    old_starts: np.ndarray
    old_lengths: np.ndarray
    old_is_full: np.ndarray  # bool
    old_is_key: np.ndarray  # bool
    event_starts: np.ndarray  # int64: where each serialized Event starts (its length below)
    event_lengths: np.ndarray  # int64

    def __len__(self) -> int:
        return self.operations.shape[0]

    def event(self, index: int) -> pb.Event:
        """Event `index` through the generated classes (for the events a consumer reads one by one)."""
        start = int(self.event_starts[index])
        return pb.Event.FromString(self.data[start:start + int(self.event_lengths[index])].tobytes())


def read_package(serialized: bytes, where: str = "message") -> tuple[pb.Package, EventColumns]:
    """The package's envelope (every field but `events`) through the generated classes, and its
    events as columns. Bytes the loop cannot read are parsed whole by the generated classes
    (which name what is wrong) and read again from their own serialization."""
    events = read_events(serialized)
    if events is None:
        package = parse_package(serialized, where)
        return package, package_events(package)
    envelope = _without_events(events.data)
    return parse_package(envelope.tobytes(), where), events


@dataclass(frozen=True)
class PackageSummary:
    """What a consumer's driver needs of a package's events, without a column per event."""

    event_count: int
    operation_counts: dict[int, int]  # pb.Operation value -> events
    first_commit_lsn: int  # of the first and the last event (0 without events)
    last_commit_lsn: int
    first_commit_time_us: int
    last_commit_time_us: int
    last_truncate: tuple[int, int] | None  # (commit LSN, position) of the last TRUNCATE


def summarize_package(serialized: bytes, where: str = "message") -> tuple[pb.Package, PackageSummary]:
    """The package's envelope (every field but `events`) and a summary of its events, read in one
    walk that keeps nothing per event: a third of `read_package`'s cost, for a driver that leaves
    the events to executors. Bytes the walk cannot read are parsed whole by the generated classes,
    which name what is wrong."""
    data = np.frombuffer(serialized, np.uint8)
    counts = np.zeros(_OPERATION_SLOTS, np.int64)
    figures = np.zeros(_FIGURES, np.int64)
    envelope = _summarize(data, counts, figures)
    if envelope is None:
        package = parse_package(serialized, where)
        summary = summarize_events(package_events(package))
        package.ClearField("events")
        return package, summary
    return parse_package(envelope.tobytes(), where), _summary(counts, figures)


def summarize_events(events: EventColumns) -> PackageSummary:
    """The same summary, of events read as columns."""
    operations = events.operations
    known = (operations >= 0) & (operations < _OPERATION_SLOTS - 1)
    counts = np.bincount(np.where(known, operations, _OPERATION_SLOTS - 1), minlength=_OPERATION_SLOTS)
    figures = np.zeros(_FIGURES, np.int64)
    count = len(events)
    figures[_COUNT] = count
    if count:
        figures[_FIRST_LSN], figures[_LAST_LSN] = events.commit_lsns[[0, -1]].view(np.int64)
        figures[_FIRST_TIME], figures[_LAST_TIME] = events.commit_times_us[[0, -1]]
        truncates = np.flatnonzero(operations == pb.TRUNCATE)
        if truncates.size:
            figures[_HAS_TRUNCATE] = 1
            figures[_TRUNCATE_LSN] = events.commit_lsns[truncates[-1]].view(np.int64)
            figures[_TRUNCATE_POSITION] = events.positions[truncates[-1]]
    return _summary(counts, figures)


def _summary(counts: np.ndarray, figures: np.ndarray) -> PackageSummary:
    unsigned = figures.view(np.uint64)
    return PackageSummary(
        event_count=int(figures[_COUNT]),
        operation_counts={(value if value < _OPERATION_SLOTS - 1 else UNKNOWN_OPERATION): int(count)
                          for value, count in enumerate(counts.tolist()) if count},
        first_commit_lsn=int(unsigned[_FIRST_LSN]), last_commit_lsn=int(unsigned[_LAST_LSN]),
        first_commit_time_us=int(figures[_FIRST_TIME]), last_commit_time_us=int(figures[_LAST_TIME]),
        last_truncate=(int(unsigned[_TRUNCATE_LSN]), int(figures[_TRUNCATE_POSITION]))
        if figures[_HAS_TRUNCATE] else None)


def package_events(package: pb.Package) -> EventColumns:
    """The events of a package built or parsed by the generated classes, as columns."""
    known = pb.Package()
    known.CopyFrom(package)
    known.DiscardUnknownFields()  # kept unknown fields would be written back as they came
    events = read_events(known.SerializeToString())
    if events is None:  # the generated classes write only what the loop reads
        raise ValueError(f"package {package.schema}.{package.table}: its events could not be read as columns")
    return events


def read_events(serialized: bytes) -> EventColumns | None:
    """The events of a serialized `pb.Package`, or None when the loop cannot read them exactly as
    the generated classes would (the caller then reads them through those)."""
    data = np.frombuffer(serialized, np.uint8)
    count = _count_events(data)
    if count < 0:
        return None
    columns = _new_columns(data, count)
    if not _read_events(data, columns.operations, columns.commit_lsns, columns.positions, columns.commit_times_us,
                        columns.has_new_row, columns.new_starts, columns.new_lengths, columns.has_old_row,
                        columns.old_starts, columns.old_lengths, columns.old_is_full, columns.old_is_key,
                        columns.event_starts, columns.event_lengths):
        return None
    return columns


def gather_spans(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Offsets (int64, one more than spans) and the concatenated bytes of data[start:start+length]
    per span: the parts of an Arrow binary column."""
    return _gather_spans(data, np.ascontiguousarray(starts, np.int64), np.ascontiguousarray(lengths, np.int64))


def gather_spans_into(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray, out: np.ndarray,
                      offsets: np.ndarray, first_span: int) -> None:
    """`gather_spans` into arrays the caller made for the spans of many sources: the bytes go to
    `out` from `offsets[first_span]` on, and `offsets[first_span + 1 + i]` is where span i ends."""
    _gather_spans_into(data, np.ascontiguousarray(starts, np.int64), np.ascontiguousarray(lengths, np.int64),
                       out, offsets, first_span)


def spans_array(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> pa.Array:
    """The spans as an Arrow binary column (large_binary past 2 GiB)."""
    return binary_array(*gather_spans(data, starts, lengths))


def binary_array(offsets: np.ndarray, values: np.ndarray) -> pa.Array:
    """An Arrow binary column (large_binary past 2 GiB) of int64 `offsets` (one more than values)
    into the bytes `values`."""
    if offsets[-1] > _INT32_MAX:
        return pa.Array.from_buffers(pa.large_binary(), len(offsets) - 1,
                                     [None, pa.py_buffer(offsets), pa.py_buffer(values)])
    return pa.Array.from_buffers(pa.binary(), len(offsets) - 1,
                                 [None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(values)])


def _new_columns(data: np.ndarray, count: int) -> EventColumns:
    return EventColumns(
        data=data, operations=np.zeros(count, np.int64), commit_lsns=np.zeros(count, np.uint64),
        positions=np.zeros(count, np.int64), commit_times_us=np.zeros(count, np.int64),
        has_new_row=np.zeros(count, np.bool_), new_starts=np.zeros(count, np.int64),
        new_lengths=np.zeros(count, np.int64), has_old_row=np.zeros(count, np.bool_),
        old_starts=np.zeros(count, np.int64), old_lengths=np.zeros(count, np.int64),
        old_is_full=np.zeros(count, np.bool_), old_is_key=np.zeros(count, np.bool_),
        event_starts=np.zeros(count, np.int64), event_lengths=np.zeros(count, np.int64))


# The compiled loops. A varint is read into (value, next position); a position of -1 means the
# data ended inside it. Wire types: 0 varint, 1 fixed 64, 2 length-delimited, 5 fixed 32.


@numba.njit(cache=True, nogil=True)
def _varint(data, pos, end):  # pragma: no cover - compiled
    value = np.uint64(0)
    shift = np.uint64(0)
    for _ in range(10):
        if pos >= end:
            return value, -1
        byte = data[pos]
        pos += 1
        value |= np.uint64(byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += np.uint64(7)
    return value, -1


@numba.njit(cache=True, nogil=True)
def _skip(data, pos, end, wire):  # pragma: no cover - compiled
    """Position after a field's value, or -1."""
    if wire == 0:
        _, pos = _varint(data, pos, end)
        return pos
    if wire == 1:
        return pos + 8 if pos + 8 <= end else -1
    if wire == 5:
        return pos + 4 if pos + 4 <= end else -1
    if wire == 2:
        length, pos = _varint(data, pos, end)
        if pos < 0 or length > np.uint64(end - pos):
            return -1
        return pos + np.int64(length)
    return -1  # groups (3, 4) and unknown wire types: left to the generated classes


@numba.njit(cache=True, nogil=True)
def _count_events(data):  # pragma: no cover - compiled
    end = data.shape[0]
    pos = 0
    count = 0
    while pos < end:
        tag, pos = _varint(data, pos, end)
        if pos < 0:
            return -1
        if np.int64(tag >> np.uint64(3)) == 6 and np.int64(tag & np.uint64(7)) == 2:
            count += 1
        pos = _skip(data, pos, end, np.int64(tag & np.uint64(7)))
        if pos < 0:
            return -1
    return count


@numba.njit(cache=True, nogil=True)
def _row_tuple(data, pos, end, previous_start, previous_length):  # pragma: no cover - compiled
    """(start, length) of the tuple of the Row in data[pos:end]; a Row sent twice merges, so a Row
    without a tuple keeps the previous one. start -1: malformed."""
    start, length = previous_start, previous_length
    while pos < end:
        tag, pos = _varint(data, pos, end)
        if pos < 0:
            return -1, 0
        field, wire = np.int64(tag >> np.uint64(3)), np.int64(tag & np.uint64(7))
        if field == _ROW_TUPLE and wire == 2:
            size, pos = _varint(data, pos, end)
            if pos < 0 or size > np.uint64(end - pos):
                return -1, 0
            start, length = pos, np.int64(size)
            pos += length
        else:
            pos = _skip(data, pos, end, wire)
            if pos < 0:
                return -1, 0
    return start, length


@numba.njit(cache=True, nogil=True, inline="always")
def _event(data, pos, stop):  # pragma: no cover - compiled
    """The fields of the serialized Event in data[pos:stop]: (ok, operation, commit LSN, position,
    commit time, has new row, its tuple's start and length, has old row, its tuple's start and
    length, old row is full, old row is key); ok is False for anything the generated classes
    would read otherwise (a known field in another wire type, a malformed row)."""
    operation, lsn, position, time = np.int64(0), np.uint64(0), np.int64(0), np.int64(0)
    has_new, new_start, new_length = False, np.int64(0), np.int64(0)
    has_old, old_start, old_length = False, np.int64(0), np.int64(0)
    old_full, old_key = False, False
    ok = False
    while pos < stop:
        tag, pos = _varint(data, pos, stop)
        if pos < 0:
            break
        field, wire = np.int64(tag >> np.uint64(3)), np.int64(tag & np.uint64(7))
        if (wire == 0 and _EVENT_FIRST_FIELD <= field <= _EVENT_LAST_FIELD and field != _EVENT_NEW_ROW
                and field != _EVENT_OLD_ROW):
            value, pos = _varint(data, pos, stop)
            if pos < 0:
                break
            if field == _EVENT_OPERATION:
                operation = np.int64(np.int32(value & np.uint64(0xFFFFFFFF)))  # enum: int32
            elif field == _EVENT_COMMIT_LSN:
                lsn = value
            elif field == _EVENT_POSITION:
                position = np.int64(value & np.uint64(0xFFFFFFFF))  # uint32
            elif field == _EVENT_COMMIT_TIME:
                time = np.int64(value)  # int64: two's complement
            elif field == _EVENT_OLD_IS_FULL:
                old_full = value != np.uint64(0)
            elif field == _EVENT_OLD_IS_KEY:
                old_key = value != np.uint64(0)
        elif wire == 2 and (field == _EVENT_NEW_ROW or field == _EVENT_OLD_ROW):  # noqa: SIM109 (numba)
            length, pos = _varint(data, pos, stop)
            if pos < 0 or length > np.uint64(stop - pos):
                pos = -1
                break
            row_end = pos + np.int64(length)
            # A Row sent twice merges: one without a tuple keeps the tuple before it.
            if field == _EVENT_NEW_ROW:
                new_start, new_length = _row_tuple(data, pos, row_end, new_start, new_length)
                has_new = True
                if new_start < 0:
                    pos = -1
                    break
            else:
                old_start, old_length = _row_tuple(data, pos, row_end, old_start, old_length)
                has_old = True
                if old_start < 0:
                    pos = -1
                    break
            pos = row_end
        elif _EVENT_FIRST_FIELD <= field <= _EVENT_LAST_FIELD:
            pos = -1  # a known field in an unexpected wire type: left to the generated classes
            break
        else:
            pos = _skip(data, pos, stop, wire)
            if pos < 0:
                break
    else:
        ok = pos == stop
    return (ok, operation, lsn, position, time, has_new, new_start, new_length, has_old, old_start, old_length,
            old_full, old_key)


@numba.njit(cache=True, nogil=True)
def _read_events(data, operations, commit_lsns, positions, commit_times, has_new, new_starts, new_lengths,
                 has_old, old_starts, old_lengths, old_is_full, old_is_key, event_starts,
                 event_lengths):  # pragma: no cover - compiled
    end = data.shape[0]
    pos = 0
    index = 0
    while pos < end:
        tag, pos = _varint(data, pos, end)
        if pos < 0:
            return False
        field, wire = np.int64(tag >> np.uint64(3)), np.int64(tag & np.uint64(7))
        if not (field == _PACKAGE_EVENTS and wire == 2):
            pos = _skip(data, pos, end, wire)
            if pos < 0:
                return False
            continue
        size, pos = _varint(data, pos, end)
        if pos < 0 or size > np.uint64(end - pos) or index >= operations.shape[0]:
            return False
        stop = pos + np.int64(size)
        event_starts[index], event_lengths[index] = pos, np.int64(size)
        (ok, operations[index], commit_lsns[index], positions[index], commit_times[index], has_new[index],
         new_starts[index], new_lengths[index], has_old[index], old_starts[index], old_lengths[index],
         old_is_full[index], old_is_key[index]) = _event(data, pos, stop)
        if not ok:
            return False
        pos = stop
        index += 1
    return index == operations.shape[0]


@numba.njit(cache=True, nogil=True)
def _summarize(data, counts, figures):  # pragma: no cover - compiled
    """The envelope (every top-level field but `events`, copied as sent), with each event's
    operation counted and the figures of `_summary` filled; None when the bytes are not read
    exactly as the generated classes would read them (as `_read_events` decides)."""
    end = data.shape[0]
    out = np.empty(end, np.uint8)
    used = 0
    pos = 0
    count = 0
    while pos < end:
        start = pos
        tag, pos = _varint(data, pos, end)
        if pos < 0:
            return None
        field, wire = np.int64(tag >> np.uint64(3)), np.int64(tag & np.uint64(7))
        if not (field == _PACKAGE_EVENTS and wire == 2):
            pos = _skip(data, pos, end, wire)
            if pos < 0:
                return None
            out[used:used + pos - start] = data[start:pos]
            used += pos - start
            continue
        size, pos = _varint(data, pos, end)
        if pos < 0 or size > np.uint64(end - pos):
            return None
        stop = pos + np.int64(size)
        ok, operation, lsn, position, time = _event(data, pos, stop)[:5]
        if not ok:
            return None
        pos = stop
        counts[operation if 0 <= operation < 15 else 15] += 1
        if count == 0:
            figures[1] = np.int64(lsn)
            figures[3] = time
        figures[2] = np.int64(lsn)
        figures[4] = time
        if operation == 4:  # TRUNCATE
            figures[5] = 1
            figures[6] = np.int64(lsn)
            figures[7] = position
        count += 1
    figures[0] = count
    return out[:used]


@numba.njit(cache=True, nogil=True)
def _without_events(data):  # pragma: no cover - compiled
    """The serialized package without its `events` fields (called on data `_read_events` read)."""
    end = data.shape[0]
    out = np.empty(end, np.uint8)
    used = 0
    pos = 0
    while pos < end:
        start = pos
        tag, pos = _varint(data, pos, end)
        pos = _skip(data, pos, end, np.int64(tag & np.uint64(7)))
        if not (np.int64(tag >> np.uint64(3)) == 6 and np.int64(tag & np.uint64(7)) == 2):
            out[used:used + pos - start] = data[start:pos]
            used += pos - start
    return out[:used]


@numba.njit(cache=True, nogil=True)
def _gather_spans_into(data, starts, lengths, out, offsets, first_span):  # pragma: no cover - compiled
    position = offsets[first_span]
    for i in range(starts.shape[0]):
        length = lengths[i]
        copy_bytes(out, position, data, starts[i], length)
        position += length
        offsets[first_span + 1 + i] = position


@numba.njit(cache=True, nogil=True)
def _gather_spans(data, starts, lengths):  # pragma: no cover - compiled
    count = starts.shape[0]
    offsets = np.zeros(count + 1, np.int64)
    for i in range(count):
        offsets[i + 1] = offsets[i] + lengths[i]
    out = np.empty(offsets[count], np.uint8)
    for i in range(count):
        copy_bytes(out, offsets[i], data, starts[i], lengths[i])
    return offsets, out
