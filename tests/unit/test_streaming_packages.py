"""Synthetic packages for the streaming tests, an in-memory Target used only by tests, and the tests
of the driver-side package assembly (chunked events, batch facts)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pyarrow as pa

from siphon_core import naming
from siphon_core.wire import siphon_pb2 as pb
from siphon_core.wire.packages import encode_package
from siphon_core.wire.tuple_data import UNCHANGED_TOAST, encode_tuple
from siphon_dagster.streaming.batch import PackageAssembler
from siphon_dagster.targets.base import (
    DELETED_COLUMN,
    VERSION_COLUMN,
    SchemaChange,
    TableSchema,
    change_batch_schema,
)

BASE_TIME_US = 1_700_000_000_000_000
TextValue = str | None | object  # object: UNCHANGED_TOAST


def column(name: str, type_oid: int = 25, type_name: str = "text", key: bool = False) -> pb.Column:
    return pb.Column(name=name, type_oid=type_oid, type_name=type_name, primary_key=key, nullable=not key,
                     type_modifier=-1)


NOTES = (column("id", 20, "bigint", key=True), column("body"), column("score", 23, "integer"))


def event(op: int, lsn: int, position: int = 1, new: Sequence[TextValue] | None = None,
          old: Sequence[TextValue] | None = None, old_full: bool = False) -> pb.Event:
    made = pb.Event(operation=op, xid=lsn, commit_lsn=lsn, position=position,
                    commit_time_us=BASE_TIME_US + lsn)
    if new is not None:
        made.new_row.tuple = encode_tuple(new)  # type: ignore[arg-type]
    if old is not None:
        made.old_row.tuple = encode_tuple(old)  # type: ignore[arg-type]
        made.old_row_is_full, made.old_row_is_key = old_full, not old_full
    return made


def insert(lsn: int, *values: TextValue, position: int = 1) -> pb.Event:
    return event(pb.INSERT, lsn, position, new=values)


def update(lsn: int, *values: TextValue, old_key: Sequence[TextValue] | None = None, position: int = 1) -> pb.Event:
    return event(pb.UPDATE, lsn, position, new=values, old=old_key)


def delete(lsn: int, *old_key: TextValue, position: int = 1) -> pb.Event:
    return event(pb.DELETE, lsn, position, old=old_key)


def truncate(lsn: int, position: int = 1) -> pb.Event:
    return event(pb.TRUNCATE, lsn, position)


def package(events: Sequence[pb.Event], columns: Sequence[pb.Column] = NOTES, schema: str = "public",
            table: str = "notes", application: str = "test") -> pb.Package:
    made = pb.Package(application_identifier=application, schema=schema, table=table, relation_id=16384,
                      value_encoding=pb.PGOUTPUT_TUPLE)
    made.columns.extend(columns)
    made.events.extend(events)
    if events:
        made.first_commit_lsn, made.first_position = events[0].commit_lsn, events[0].position
        made.last_commit_lsn, made.last_position = events[-1].commit_lsn, events[-1].position
    return made


def sliced(whole: pb.Package, slice_bytes: int) -> list[pb.Package]:
    """The producer's slicing of a package's single event (see `Chunk` in the proto)."""
    data = whole.events[0].SerializeToString()
    parts = [data[i : i + slice_bytes] for i in range(0, len(data), slice_bytes)]
    slices = []
    for index, part in enumerate(parts):
        piece = pb.Package()
        piece.CopyFrom(whole)
        piece.ClearField("events")
        piece.chunk.index, piece.chunk.count = index, len(parts)
        piece.event_chunk = part
        slices.append(piece)
    return slices


@dataclass
class MemoryTarget:
    """The Target protocol over a dict, with the version rule; only for tests of the streaming engine."""

    name: str = "memory"
    rows: dict[tuple[str | None, ...], tuple[int, bool, dict[str, str | None]]] = field(default_factory=dict)
    schemas: list[TableSchema] = field(default_factory=list)
    backfills: list[dict[str, str]] = field(default_factory=list)  # what each ensure_table was given
    truncations: list[int] = field(default_factory=list)
    incompatible: list[str] = field(default_factory=list)
    fail_apply: int = 0  # the next N apply_rows calls raise
    down: bool = False  # ping raises, as a target that does not answer
    applied_batches: int = 0
    superseded_rows_allowed: bool = False  # apply_rows keeps each key's greatest version either way

    def ensure_table(self, table: TableSchema, backfill: Mapping[str, str] | None = None) -> SchemaChange:
        known = {c.name for s in self.schemas for c in s.columns}
        self.schemas.append(table)
        self.backfills.append(dict(backfill or {}))
        added = [c.name for c in table.columns if known and c.name not in known]
        for _version, _deleted, row in self.rows.values():
            row.update({name: (backfill or {}).get(name) for name in added})
        return SchemaChange(created=len(self.schemas) == 1, added_columns=added,
                            incompatible=list(self.incompatible))

    def ping(self) -> None:
        if self.down:
            raise ConnectionRefusedError("target unavailable")

    def apply_rows(self, table: TableSchema, rows: pa.Table) -> int:
        if self.fail_apply:
            self.fail_apply -= 1
            raise RuntimeError("target unavailable")
        assert rows.schema == change_batch_schema(table)
        keys = [c.name for c in table.key_columns]
        for row in rows.to_pylist():
            version, deleted = int(row.pop(VERSION_COLUMN)), row.pop(DELETED_COLUMN)
            key = tuple(row[name] for name in keys)
            stored = self.rows.get(key)
            if stored is None or version > stored[0]:
                self.rows[key] = (version, deleted, row)
        self.applied_batches += 1
        return rows.num_rows

    def tombstone_all(self, table: TableSchema, version: int) -> int:
        self.truncations.append(version)
        older = [k for k, (v, deleted, _) in self.rows.items() if v < version and not deleted]
        for key in older:
            self.rows[key] = (version, True, self.rows[key][2])
        return len(older)

    def read_current_values(self, table: TableSchema, keys: Sequence[tuple[str, ...]],
                            columns: Sequence[str]) -> dict[tuple[str, ...], dict[str, str | None]]:
        found = {}
        for key in keys:
            stored = self.rows.get(tuple(key))
            if stored is not None and not stored[1]:
                found[tuple(key)] = {name: stored[2].get(name) for name in columns}
        return found

    def current(self) -> dict[tuple[str | None, ...], dict[str, str | None]]:
        return {key: values for key, (_, deleted, values) in sorted(self.rows.items()) if not deleted}

    def close(self) -> None:
        pass


def test_whole_packages_pass_through_with_their_facts() -> None:
    made = package([insert(0x10, "1", "a", "5"), truncate(0x11, 2), update(0x12, "1", "b", "6")])
    received = PackageAssembler().accept(7, encode_package(made))
    assert received is not None
    assert received.sequences == (7,)
    assert dict(received.operations) == {"insert": 1, "truncate": 1, "update": 1}
    assert received.truncated_at == naming.row_version(0x11, 2)
    assert (received.first_commit_lsn, received.last_commit_lsn) == (0x10, 0x12)
    assert (received.oldest_commit_time_us, received.newest_commit_time_us) == (BASE_TIME_US + 0x10, BASE_TIME_US + 0x12)


def test_packages_repeating_a_column_list_share_it_and_any_change_is_seen() -> None:
    assembler = PackageAssembler()
    first = assembler.accept(1, encode_package(package([insert(0x10, "1", "a", "5")])))
    second = assembler.accept(2, encode_package(package([insert(0x11, "2", "b", "6")])))
    assert first is not None and second is not None
    assert second.columns is first.columns  # read once, not copied out of every package
    assert second.fingerprint == first.fingerprint == (("id", 20, -1, True), ("body", 25, -1, False),
                                                       ("score", 23, -1, False))
    # A change of any attribute is a new list, even one the fingerprint leaves out (nullable).
    not_null = (*NOTES[:2], pb.Column(name="score", type_oid=23, type_name="integer", nullable=False,
                                      type_modifier=-1))
    third = assembler.accept(3, encode_package(package([insert(0x12, "3", "c", "7")], columns=not_null)))
    assert third is not None and third.columns is not first.columns
    assert [c.nullable for c in third.columns] == [False, True, False]
    assert third.fingerprint == first.fingerprint
    widened = (*NOTES[:2], column("score", 20, "bigint"))
    fourth = assembler.accept(4, encode_package(package([insert(0x13, "4", "d", "8")], columns=widened)))
    assert fourth is not None and fourth.fingerprint[2] == ("score", 20, -1, False)
    assert [c.type_name for c in fourth.columns] == ["bigint", "text", "bigint"]


def test_slices_of_a_large_event_become_one_package_after_the_last_slice() -> None:
    whole = package([insert(0x20, "1", "x" * 5000, "1")])
    slices = sliced(whole, 1500)
    assembler = PackageAssembler()
    results = [assembler.accept(100 + i, encode_package(piece)) for i, piece in enumerate(slices)]
    assert results[:-1] == [None] * (len(slices) - 1)
    assert assembler.held_sequences == ()
    assembled = results[-1]
    assert assembled is not None and assembled.sequences == tuple(range(100, 100 + len(slices)))
    assert dict(assembled.operations) == {"insert": 1}


def test_a_resent_sliced_event_supersedes_the_partial_one() -> None:
    slices = sliced(package([insert(0x20, "1", "y" * 4000, "1")]), 1500)
    assembler = PackageAssembler()
    assert assembler.accept(1, encode_package(slices[0])) is None
    assert assembler.accept(2, encode_package(slices[1])) is None
    assert assembler.held_sequences == (1, 2)
    results = [assembler.accept(10 + i, encode_package(piece)) for i, piece in enumerate(slices)]
    assert results[-1] is not None and results[-1].sequences == tuple(range(10, 10 + len(slices)))
    assert assembler.take_abandoned() == [1, 2]
    assert assembler.take_abandoned() == []


def test_unchanged_marker_survives_the_package_round_trip() -> None:
    made = package([update(5, "1", UNCHANGED_TOAST, "2")])
    received = PackageAssembler().accept(1, encode_package(made))
    assert received is not None and dict(received.operations) == {"update": 1}
