"""What the driver learns from a micro-batch's messages before any Spark work.

Parsing a package on the driver is cheap (zstd and protobuf run in C); decoding its row tuples is
the costly part and is left to the executors. The driver reassembles sliced events (rare), and
reads the column list, LSNs, commit times and operation counts that the batch report and the
schema step need.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from siphon_core import naming
from siphon_core.wire import siphon_pb2 as pb
from siphon_core.wire.packages import ChunkReassembler, decode_package, encode_package
from siphon_dagster.targets.base import SourceColumn, TableSchema

OPERATION_NAMES = {pb.INSERT: "insert", pb.UPDATE: "update", pb.DELETE: "delete", pb.TRUNCATE: "truncate",
                   pb.SNAPSHOT: "snapshot"}


class SchemaChangeError(RuntimeError):
    """The source table changed in a way this table's stream cannot follow; the message says how."""


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


def describe(package: pb.Package, sequences: tuple[int, ...], payload: bytes) -> ReceivedPackage:
    operations: Counter[str] = Counter()
    truncated_at = None
    oldest = newest = 0
    for event in package.events:
        operations[OPERATION_NAMES.get(event.operation, "unknown")] += 1
        if event.operation == pb.TRUNCATE:
            truncated_at = naming.row_version(event.commit_lsn, event.position)
        time_us = event.commit_time_us
        oldest = time_us if not oldest else min(oldest, time_us)
        newest = max(newest, time_us)
    return ReceivedPackage(
        sequences=sequences, payload=payload, columns=tuple(package.columns),
        first_commit_lsn=package.first_commit_lsn or (package.events[0].commit_lsn if package.events else 0),
        last_commit_lsn=package.last_commit_lsn or (package.events[-1].commit_lsn if package.events else 0),
        oldest_commit_time_us=oldest, newest_commit_time_us=newest, operations=operations,
        truncated_at=truncated_at,
    )


@dataclass
class PackageAssembler:
    """Turns messages, in stream order, into whole packages; slices wait for their last slice."""

    _reassembler: ChunkReassembler = field(default_factory=ChunkReassembler)
    _slices: list[int] = field(default_factory=list)  # stream sequences of the sliced event in progress
    _abandoned: list[int] = field(default_factory=list)

    def accept(self, sequence: int, data: bytes) -> ReceivedPackage | None:
        """Raises siphon_core.wire.packages.PackageError for a message that is not a package."""
        package = decode_package(data, f"stream sequence {sequence}")
        if not package.HasField("chunk"):
            return describe(package, (sequence,), data)
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


def column_fingerprint(columns: Sequence[pb.Column]) -> tuple[tuple[str, int, int, bool], ...]:
    return tuple((c.name, c.type_oid, c.type_modifier, c.primary_key) for c in columns)


def table_schema(schema: str, table: str, columns: Sequence[pb.Column],
                 type_categories: dict[int, tuple[str, int]] | None = None) -> TableSchema:
    """The table as a package describes it; `type_categories` (oid -> typcategory, typelem) from the
    source catalog makes it identical to what the snapshot path reads."""
    categories = type_categories or {}
    return TableSchema(schema, table, tuple(
        SourceColumn(name=c.name, type_oid=c.type_oid, type_name=c.type_name, type_modifier=c.type_modifier,
                     nullable=c.nullable, primary_key=c.primary_key,
                     category=categories.get(c.type_oid, ("", 0))[0],
                     element_type_oid=categories.get(c.type_oid, ("", 0))[1])
        for c in columns
    ))


def check_keys(qualified_name: str, packages: Sequence[ReceivedPackage]) -> tuple[str, ...]:
    """The primary key shared by every package of the batch; a change of key cannot be streamed."""
    newest = tuple(c.name for c in packages[-1].columns if c.primary_key)
    if not newest:
        raise SchemaChangeError(f"table {qualified_name}: packages name no primary key columns; Siphon needs a "
                                "primary key or REPLICA IDENTITY FULL on the source table")
    for package in packages:
        keys = tuple(c.name for c in package.columns if c.primary_key)
        if keys != newest:
            raise SchemaChangeError(
                f"table {qualified_name}: the primary key changed from {list(keys)} (stream sequence "
                f"{package.sequence}) to {list(newest)} (stream sequence {packages[-1].sequence}); rebuild the "
                "table's targets with its resync job")
    return newest
