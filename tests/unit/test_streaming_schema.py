"""The column list a batch is applied under, what reaches the target's `ensure_table`, and what an
added column's older rows hold."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from siphon_core.wire import siphon_pb2 as pb
from siphon_core.wire.packages import encode_package
from siphon_dagster.source import ExistingRowsValue
from siphon_dagster.streaming.batch import PackageAssembler, ReceivedPackage
from siphon_dagster.streaming.schema import IncompatibleSchemaError, SchemaChangeError, SchemaTracker
from siphon_dagster.targets.base import SourceColumn, TableSchema
from tests.unit.test_streaming_packages import NOTES, MemoryTarget, column, insert, package

WITH_TAG = (*NOTES, column("tag"))
REKEYED = (column("id", 20, "bigint"), column("body", key=True), column("score", 23, "integer"))


def received(*specs: tuple[int, tuple[pb.Column, ...]]) -> list[ReceivedPackage]:
    """One package per (commit LSN, column list), stream sequences 1, 2, ..."""
    assembler = PackageAssembler()
    values = {3: ("1", "a", "1"), 4: ("1", "a", "1", "t")}
    return [assembler.accept(i + 1, encode_package(package([insert(lsn, *values[len(columns)])], columns=columns)))  # type: ignore[misc]
            for i, (lsn, columns) in enumerate(specs)]


def test_a_new_column_list_is_ensured_once_and_the_newest_of_a_batch_wins() -> None:
    target = MemoryTarget()
    tracker = SchemaTracker(target, "public", "notes")  # type: ignore[arg-type]
    assert tracker.resolve(received((0x10, NOTES))).column_names == ("id", "body", "score")
    tracker.resolve(received((0x11, NOTES)))
    assert tracker.resolve(received((0x12, NOTES), (0x13, WITH_TAG))).column_names == ("id", "body", "score", "tag")
    assert [len(s.columns) for s in target.schemas] == [3, 4]


def test_a_late_replay_of_older_packages_does_not_roll_the_schema_back() -> None:
    target = MemoryTarget()
    tracker = SchemaTracker(target, "public", "notes")  # type: ignore[arg-type]
    tracker.resolve(received((0x20, WITH_TAG)))
    assert tracker.resolve(received((0x10, NOTES))).column_names == ("id", "body", "score", "tag")
    # Within a batch the newest list is chosen by commit LSN, not by arrival.
    assert SchemaTracker(MemoryTarget(), "public", "notes").resolve(  # type: ignore[arg-type]
        received((0x30, WITH_TAG), (0x10, NOTES))).column_names == ("id", "body", "score", "tag")
    assert len(target.schemas) == 1


def test_a_change_of_primary_key_is_refused_within_a_batch_and_across_batches() -> None:
    tracker = SchemaTracker(MemoryTarget(), "public", "notes")  # type: ignore[arg-type]
    with pytest.raises(SchemaChangeError, match=r"public\.notes: the primary key changed from \['id'\] \(stream "
                                                r"sequence 1\) to \['body'\] \(stream sequence 2\)"):
        tracker.resolve(received((0x10, NOTES), (0x11, REKEYED)))
    tracker.resolve(received((0x10, NOTES)))
    with pytest.raises(SchemaChangeError, match=r"from \['id'\] \(the batches applied before\) to \['body'\]"):
        tracker.resolve(received((0x11, REKEYED)))


def test_a_type_change_the_target_cannot_follow_stops_naming_table_and_column() -> None:
    target = MemoryTarget(incompatible=["score: source type text maps to String, the table has Int32"])
    with pytest.raises(IncompatibleSchemaError, match=r"public\.notes: target memory cannot follow the source's "
                                                      r"schema as of stream sequence 1: score: source type text"):
        SchemaTracker(target, "public", "notes").resolve(received((0x10, NOTES)))  # type: ignore[arg-type]


class CatalogReader:
    """The catalog side of SourceRowReader: what rows that predate each column hold."""

    def __init__(self, **values: ExistingRowsValue) -> None:
        self.values = values
        self.asked: list[list[str]] = []

    def existing_rows_values(self, table: TableSchema, columns: Sequence[SourceColumn]) -> dict[str, ExistingRowsValue]:
        self.asked.append([c.name for c in columns])
        return {c.name: self.values.get(c.name, ExistingRowsValue.null(c.name)) for c in columns}

    def type_categories(self, type_oids: Sequence[int]) -> dict[int, tuple[str, int]]:
        return {}


def test_an_added_column_is_added_holding_the_value_the_source_gave_older_rows() -> None:
    target = MemoryTarget()
    reader = CatalogReader(tag=ExistingRowsValue("tag", True, "seven"))
    tracker = SchemaTracker(target, "public", "notes", reader)  # type: ignore[arg-type]
    tracker.resolve(received((0x10, NOTES)))
    tracker.resolve(received((0x11, WITH_TAG)))
    # A run's first list may meet columns the target lacks; afterwards only new columns are asked for.
    assert reader.asked == [["body", "score"], ["tag"]]
    assert target.backfills == [{}, {"tag": "seven"}]
    assert tracker.take_warnings() == []


def test_an_added_column_whose_older_values_the_catalog_does_not_keep_is_reported() -> None:
    reason = "it has DEFAULT clock_timestamp() and the catalog keeps no value for older rows"
    target = MemoryTarget()
    reader = CatalogReader(tag=ExistingRowsValue("tag", False, reason=reason))
    tracker = SchemaTracker(target, "public", "notes", reader)  # type: ignore[arg-type]
    tracker.resolve(received((0x10, NOTES)))
    tracker.resolve(received((0x11, WITH_TAG)))
    assert target.backfills[-1] == {}
    [warning] = tracker.take_warnings()
    assert warning.startswith("table public.notes: column 'tag' was added at the source")
    assert reason in warning and "target memory" in warning and "materialize every partition of asset memory/public/notes" in warning
    assert tracker.take_warnings() == []
    tracker.resolve(received((0x12, WITH_TAG)))  # the same list again: nothing new to say
    assert tracker.take_warnings() == []


def test_without_a_source_an_added_column_is_reported_as_unknown() -> None:
    tracker = SchemaTracker(MemoryTarget(), "public", "notes")  # type: ignore[arg-type]
    tracker.resolve(received((0x10, NOTES)))
    assert tracker.take_warnings() == []
    tracker.resolve(received((0x11, WITH_TAG)))
    [warning] = tracker.take_warnings()
    assert "column 'tag'" in warning and "no source connection" in warning
