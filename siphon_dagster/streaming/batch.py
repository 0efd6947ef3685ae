"""What the driver learns from a micro-batch's messages before any Spark work.

Parsing a package on the driver is cheap (zstd and protobuf run in C); decoding its row tuples is
the costly part and is left to the executors. The driver reassembles sliced events (rare), and
reads the column list, LSNs, commit times and operation counts that the batch report and the
schema step need.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from siphon_core import naming
from siphon_core.wire import siphon_pb2 as pb
from siphon_core.wire.event_columns import EventColumns, package_events, read_package
from siphon_core.wire.packages import ChunkReassembler, decompress_package, encode_package

OPERATION_NAMES = {pb.INSERT: "insert", pb.UPDATE: "update", pb.DELETE: "delete", pb.TRUNCATE: "truncate",
                   pb.SNAPSHOT: "snapshot"}
_OPERATION_VALUES = pb.Operation.values()


@dataclass(frozen=True)
class ReceivedPackage:
    """One whole package: a message, or the slices of an event too large for one message."""

    sequences: tuple[int, ...]  # stream sequences of its messages, in order
    payload: bytes  # compressed package (re-encoded when assembled from slices)
    columns: tuple[pb.Column, ...]
    first_commit_lsn: int
    last_commit_lsn: int
    oldest_commit_time_us: int
    newest_commit_time_us: int
    operations: Counter[str]
    truncated_at: int | None  # version of its last TRUNCATE

    @property
    def sequence(self) -> int:
        return self.sequences[-1]


def describe(package: pb.Package, sequences: tuple[int, ...], payload: bytes,
             events: EventColumns | None = None) -> ReceivedPackage:
    """What the driver needs of a package; `events` are its events as columns when they were read
    with it (`event_columns.read_package`)."""
    if events is None:
        events = package_events(package)
    operations_by_value = np.bincount(events.operations[events.operations >= 0],
                                      minlength=len(_OPERATION_VALUES))
    operations: Counter[str] = Counter()
    for value, count in enumerate(operations_by_value.tolist()):
        if count:
            operations[OPERATION_NAMES.get(value, "unknown")] += count
    truncated_at = None
    truncates = np.flatnonzero(events.operations == pb.TRUNCATE)
    if truncates.size:
        last = int(truncates[-1])
        truncated_at = naming.row_version(int(events.commit_lsns[last]), int(events.positions[last]))
    # Events are in commit order: the first and the last carry the oldest and newest commit times.
    times = events.commit_times_us
    oldest, newest = (int(min(times[0], times[-1])), int(max(times[0], times[-1]))) if len(events) else (0, 0)
    return ReceivedPackage(
        sequences=sequences, payload=payload, columns=tuple(_detached(c) for c in package.columns),
        first_commit_lsn=package.first_commit_lsn or (int(events.commit_lsns[0]) if len(events) else 0),
        last_commit_lsn=package.last_commit_lsn or (int(events.commit_lsns[-1]) if len(events) else 0),
        oldest_commit_time_us=oldest, newest_commit_time_us=newest, operations=operations,
        truncated_at=truncated_at,
    )


def _detached(column: pb.Column) -> pb.Column:
    """A copy that does not keep the parsed package (and its events) alive for the whole batch."""
    copy = pb.Column()
    copy.CopyFrom(column)
    return copy


@dataclass
class PackageAssembler:
    """Turns messages, in stream order, into whole packages; slices wait for their last slice."""

    _reassembler: ChunkReassembler = field(default_factory=ChunkReassembler)
    _slices: list[int] = field(default_factory=list)  # stream sequences of the sliced event in progress
    _abandoned: list[int] = field(default_factory=list)

    def accept(self, sequence: int, data: bytes) -> ReceivedPackage | None:
        """Raises siphon_core.wire.packages.PackageError for a message that is not a package."""
        where = f"stream sequence {sequence}"
        package, events = read_package(decompress_package(data, where), where)
        if not package.HasField("chunk"):
            return describe(package, (sequence,), data, events)
        if package.chunk.index != len(self._slices):
            # A resent event starts again at slice 0 and supersedes the partial one (as the
            # reassembler does); a slice out of place is dropped with it.
            self._abandoned += self._slices
            self._slices = []
            if package.chunk.index != 0:
                self._abandoned.append(sequence)
        whole = self._reassembler.accept(package)
        if package.chunk.index == len(self._slices):
            self._slices.append(sequence)
        if whole is None:
            return None
        sequences, self._slices = tuple(self._slices), []
        return describe(whole, sequences, encode_package(whole))

    @property
    def held_sequences(self) -> tuple[int, ...]:
        """Messages of a sliced event still waiting for its remaining slices (not to be acked yet)."""
        return tuple(self._slices)

    def take_abandoned(self) -> list[int]:
        """Messages of superseded partial events: acked with the next batch, never applied."""
        abandoned, self._abandoned = self._abandoned, []
        return abandoned
