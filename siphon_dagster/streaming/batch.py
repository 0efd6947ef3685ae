"""What the driver learns from a micro-batch's messages before any Spark work.

Parsing a package on the driver is cheap (zstd and protobuf run in C); decoding its row tuples is
the costly part and is left to the executors. The driver reassembles sliced events (rare), and
reads the column list, LSNs, commit times and operation counts that the batch report and the
schema step need, in one walk over the package that keeps nothing per event
(`event_columns.summarize_package`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from siphon_core import naming
from siphon_core.wire import siphon_pb2 as pb
from siphon_core.wire.event_columns import (
    UNKNOWN_OPERATION,
    PackageSummary,
    package_events,
    summarize_events,
    summarize_package,
)
from siphon_core.wire.packages import ChunkReassembler, PackageError, decompress_package, encode_package

OPERATION_NAMES = {pb.INSERT: "insert", pb.UPDATE: "update", pb.DELETE: "delete", pb.TRUNCATE: "truncate",
                   pb.SNAPSHOT: "snapshot"}


Fingerprint = tuple[tuple[str, int, int, bool], ...]


def column_fingerprint(columns: Sequence[pb.Column]) -> Fingerprint:
    """What makes two column lists the same list to the target: names, types and the key."""
    return tuple((c.name, c.type_oid, c.type_modifier, c.primary_key) for c in columns)


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
    # What the schema step compares (`column_fingerprint`), read once here, on the thread that
    # reads the package: the event loop would otherwise read every column of every package.
    fingerprint: Fingerprint = ()

    @property
    def sequence(self) -> int:
        return self.sequences[-1]


class _ColumnCache:
    """The column list of the package read last, detached, reused while packages repeat it: a
    table's packages almost always carry the same list, and copying it out of every package (a
    wide table has tens of columns) cost more than the rest of reading a small package."""

    def __init__(self) -> None:
        self._described: tuple[tuple[object, ...], ...] | None = None
        self._columns: tuple[pb.Column, ...] = ()
        self._fingerprint: Fingerprint = ()

    def columns(self, package: pb.Package) -> tuple[tuple[pb.Column, ...], Fingerprint]:
        described = tuple((c.name, c.type_oid, c.type_name, c.primary_key, c.type_modifier, c.nullable)
                          for c in package.columns)
        if described != self._described:
            self._described = described
            self._columns = tuple(_detached(c) for c in package.columns)
            self._fingerprint = column_fingerprint(self._columns)
        return self._columns, self._fingerprint


def describe(package: pb.Package, sequences: tuple[int, ...], payload: bytes,
             summary: PackageSummary | None = None, cache: _ColumnCache | None = None) -> ReceivedPackage:
    """What the driver needs of a package; `summary` is its events' summary when it was read with
    it (`event_columns.summarize_package`)."""
    if summary is None:
        summary = summarize_events(package_events(package))
    operations: Counter[str] = Counter()
    for value, count in summary.operation_counts.items():
        operations[OPERATION_NAMES.get(value, "unknown") if value != UNKNOWN_OPERATION else "unknown"] += count
    truncated_at = naming.row_version(*summary.last_truncate) if summary.last_truncate is not None else None
    # Events are in commit order: the first and the last carry the oldest and newest commit times.
    first_time, last_time = summary.first_commit_time_us, summary.last_commit_time_us
    columns, fingerprint = (cache or _ColumnCache()).columns(package)
    return ReceivedPackage(
        sequences=sequences, payload=payload, columns=columns, fingerprint=fingerprint,
        first_commit_lsn=package.first_commit_lsn or summary.first_commit_lsn,
        last_commit_lsn=package.last_commit_lsn or summary.last_commit_lsn,
        oldest_commit_time_us=min(first_time, last_time), newest_commit_time_us=max(first_time, last_time),
        operations=operations, truncated_at=truncated_at,
    )


def _detached(column: pb.Column) -> pb.Column:
    """A copy that does not keep the parsed package (and its events) alive for the whole batch."""
    copy = pb.Column()
    copy.CopyFrom(column)
    return copy


# A producer cuts packages below the queue's message limit; anything that expands past this many
# times that limit is no package of ours, whatever its few compressed bytes claim.
MAX_EXPANSION_OF_MESSAGE_LIMIT = 4
_VALID_OPERATIONS = frozenset(OPERATION_NAMES)


def check_package(package: pb.Package, summary: PackageSummary, schema: str | None, table: str | None,
                  where: str) -> None:
    """Refuses, as a bad message, what no producer writes: a package of another table, without
    columns, primary key or events, or with events of no known operation. Such a message must go
    through the table's `on_error` (dead-letter or stop), never be taken for a schema change."""
    if not package.columns and not package.HasField("chunk") and summary.event_count == 0:
        raise PackageError(f"{where}: an empty package (without columns or events)")
    if schema is not None and (package.schema, package.table) != (schema, table):
        raise PackageError(f"{where}: a package of table {package.schema!r}.{package.table!r} on the subject of "
                           f"{schema}.{table}")
    names = [c.name for c in package.columns]
    if not names:
        raise PackageError(f"{where}: a package without columns")
    if len(set(names)) != len(names):
        raise PackageError(f"{where}: a package whose columns repeat a name ({names})")
    if not any(c.primary_key for c in package.columns):
        raise PackageError(f"{where}: a package whose columns name no primary key")
    if package.HasField("chunk"):
        if package.chunk.count < 1 or package.chunk.index >= package.chunk.count or not package.event_chunk:
            raise PackageError(f"{where}: an event slice {package.chunk.index} of {package.chunk.count} "
                               f"with {len(package.event_chunk)} bytes")
        return
    if summary.event_count == 0:
        raise PackageError(f"{where}: a package without events")
    unknown = {op for op in summary.operation_counts if op not in _VALID_OPERATIONS}
    if unknown:
        raise PackageError(f"{where}: events with unknown operations {sorted(unknown)}")


@dataclass
class PackageAssembler:
    """Turns messages, in stream order, into whole packages; slices wait for their last slice.

    With `schema` and `table` set, every message must be a valid package of that table
    (`check_package`); `max_package_bytes` bounds what one message may decompress to."""

    schema: str | None = None
    table: str | None = None
    max_package_bytes: int | None = None
    _reassembler: ChunkReassembler = field(default_factory=ChunkReassembler)
    _slices: list[int] = field(default_factory=list)  # stream sequences of the sliced event in progress
    _abandoned: list[int] = field(default_factory=list)
    _columns: _ColumnCache = field(default_factory=_ColumnCache)

    def accept(self, sequence: int, data: bytes) -> ReceivedPackage | None:
        """Raises siphon_core.wire.packages.PackageError for a message that is not a package."""
        where = f"stream sequence {sequence}"
        package, summary = summarize_package(decompress_package(data, where, self.max_package_bytes), where)
        check_package(package, summary, self.schema, self.table, where)
        if not package.HasField("chunk"):
            return describe(package, (sequence,), data, summary, self._columns)
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
        return describe(whole, sequences, encode_package(whole), cache=self._columns)

    @property
    def held_sequences(self) -> tuple[int, ...]:
        """Messages of a sliced event still waiting for its remaining slices (not to be acked yet)."""
        return tuple(self._slices)

    def take_abandoned(self) -> list[int]:
        """Messages of superseded partial events: acked with the next batch, never applied."""
        abandoned, self._abandoned = self._abandoned, []
        return abandoned
