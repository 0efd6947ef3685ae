"""Decode and fold of micro-batches on a real local Spark session, applied to the in-memory test
target: every case of the ordering contract a batch can contain (DESIGN.md, section 3)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import pytest
from pyspark.errors import PythonException
from pyspark.sql import SparkSession

from siphon_core import naming
from siphon_core.wire import siphon_pb2 as pb
from siphon_core.wire.packages import encode_package
from siphon_core.wire.tuple_data import UNCHANGED_TOAST as U
from siphon_core.wire.tuple_data import encode_tuple
from siphon_dagster.source import ExistingRowsValue
from siphon_dagster.streaming import spark_plan
from siphon_dagster.streaming.apply import AppliedBatch, BatchApplier
from siphon_dagster.streaming.batch import PackageAssembler
from siphon_dagster.streaming.spark_session import get_spark_session
from siphon_dagster.streaming.toast import UnchangedValueError
from siphon_dagster.targets.base import SourceColumn, TableSchema
from tests.unit.test_streaming_packages import (
    NOTES,
    MemoryTarget,
    column,
    delete,
    insert,
    package,
    sliced,
    truncate,
    update,
)

BIG = "x" * 3000  # stands for a TOASTed value


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    yield get_spark_session()  # the process's one session, shared with every streaming test


@dataclass
class FakeSource:
    """The source's current rows by key, as SourceRowReader returns them."""

    rows: dict[tuple[str, ...], dict[str, str | None]] = field(default_factory=dict)
    asked: list[tuple[tuple[str, ...], tuple[str, ...]]] = field(default_factory=list)

    def read_rows(self, table: TableSchema, keys: Sequence[tuple[str, ...]],
                  columns: Sequence[str]) -> dict[tuple[str, ...], dict[str, str | None]]:
        self.asked += [(tuple(key), tuple(columns)) for key in keys]
        return {key: {c: self.rows[key].get(c) for c in columns} for key in keys if key in self.rows}

    def type_categories(self, type_oids: Sequence[int]) -> dict[int, tuple[str, int]]:
        return {}

    def existing_rows_values(self, table: TableSchema,
                             columns: Sequence[SourceColumn]) -> dict[str, ExistingRowsValue]:
        return {c.name: ExistingRowsValue.null(c.name) for c in columns}  # columns added without a DEFAULT


def apply(spark: SparkSession, target: MemoryTarget, *packages: pb.Package, source: FakeSource | None = None,
          applier: BatchApplier | None = None) -> AppliedBatch:
    assembler = PackageAssembler()
    received = [assembler.accept(i + 1, encode_package(p)) for i, p in enumerate(packages)]
    applier = applier or BatchApplier(spark, target, "public", "notes", source)  # type: ignore[arg-type]
    return applier.apply([r for r in received if r is not None])


def rows(target: MemoryTarget) -> dict[str, tuple[str | None, ...]]:
    return {key[0]: tuple(values.values()) for key, values in target.current().items()}  # type: ignore[misc]


def test_latest_change_of_each_key_wins_and_deletes_leave_tombstones(spark: SparkSession) -> None:
    target = MemoryTarget()
    applied = apply(spark, target, package([
        insert(0x10, "1", "a", "1"), insert(0x10, "2", "b", "2", position=2),
        update(0x11, "1", "a2", "10"), delete(0x12, "2", None, None),
        insert(0x13, "3", "c", "3"), delete(0x14, "3", None, None), insert(0x15, "3", "c2", "30"),
    ]))
    assert applied.rows == 3  # one row per key
    assert rows(target) == {"1": ("1", "a2", "10"), "3": ("3", "c2", "30")}
    assert target.rows[("2",)][:2] == (naming.row_version(0x12, 1), True)


def test_a_target_that_allows_superseded_rows_gets_them_and_stores_the_same_rows(
        spark: SparkSession, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spark_plan, "DECODED_BYTES_PER_FLUSH", 1)  # a piece per package
    batch = [package([insert(0x10, "1", "a", "1"), insert(0x10, "2", "b", "2", position=2)]),
             package([update(0x20, "1", "a2", "5"), delete(0x21, "2", None, None), insert(0x22, "3", "c", "3")]),
             package([update(0x30, "3", "c2", "6"), insert(0x31, "2", "b2", "7")])]
    merged, together = MemoryTarget(), MemoryTarget(superseded_rows_allowed=True)

    def in_driver(target: MemoryTarget) -> BatchApplier:  # decoded in this process, where the flush size holds
        return BatchApplier(spark, target, "public", "notes", driver_decode_max_bytes=1 << 20)  # type: ignore[arg-type]

    assert apply(spark, merged, *batch, applier=in_driver(merged)).rows == 3
    # Every piece's row of each key, the older ones superseded at the target.
    assert apply(spark, together, *batch, applier=in_driver(together)).rows == 7
    assert rows(together) == rows(merged) == {"1": ("1", "a2", "5"), "2": ("2", "b2", "7"), "3": ("3", "c2", "6")}
    assert together.rows == merged.rows


def test_duplicated_and_out_of_order_packages_converge_to_the_same_rows(spark: SparkSession) -> None:
    first = package([insert(0x10, "1", "a", "1"), insert(0x10, "2", "b", "2", position=2)])
    second = package([update(0x20, "1", "a2", "5"), delete(0x21, "2", None, None)])
    in_order, shuffled = MemoryTarget(), MemoryTarget()
    apply(spark, in_order, first, second)
    apply(spark, shuffled, second, first, second, first)
    assert rows(shuffled) == rows(in_order) == {"1": ("1", "a2", "5")}
    assert shuffled.rows == in_order.rows


def test_primary_key_update_is_a_delete_of_the_old_key_and_an_insert_of_the_new(spark: SparkSession) -> None:
    target = MemoryTarget()
    apply(spark, target, package([insert(0x10, "1", "a", "1"), update(0x11, "7", "a", "1", old_key=["1", None, None])]))
    assert rows(target) == {"7": ("7", "a", "1")}
    assert target.rows[("1",)][:2] == (naming.row_version(0x11, 1), True)


def test_unchanged_toast_is_carried_from_an_earlier_change_in_the_batch(spark: SparkSession) -> None:
    target = MemoryTarget(rows={("1",): (1, False, {"id": "1", "body": "stale", "score": "0"})})
    applied = apply(spark, target, package([
        update(0x10, "1", BIG, "1"), update(0x11, "1", U, "2"), update(0x12, "1", U, "3"),
    ]))
    assert rows(target) == {"1": ("1", BIG, "3")}
    assert (applied.toast.from_batch, applied.toast.from_target) == (1, 0)  # the stale stored row is not used


def test_unchanged_toast_comes_from_the_target_row_and_never_becomes_null(spark: SparkSession) -> None:
    target = MemoryTarget()
    apply(spark, target, package([insert(0x10, "1", BIG, "1"), insert(0x10, "2", "small", "2", position=2)]))
    applied = apply(spark, target, package([update(0x20, "1", U, "5"), update(0x21, "2", U, "6")]))
    assert rows(target) == {"1": ("1", BIG, "5"), "2": ("2", "small", "6")}
    assert applied.toast.from_target == 2


def test_unchanged_toast_is_re_read_from_the_source_when_the_target_has_no_row(spark: SparkSession) -> None:
    target = MemoryTarget()
    source = FakeSource(rows={("1",): {"id": "1", "body": "from source", "score": "9"}})
    applied = apply(spark, target, package([update(0x20, "1", U, "5"), update(0x21, "2", U, "6")]), source=source)
    # Key 2 is gone at the source: its change is left out (a later delete or key update supersedes it),
    # so no unknown value is ever stored for a later key update to copy.
    assert rows(target) == {"1": ("1", "from source", "5")}
    assert sorted(source.asked) == [(("1",), ("body",)), (("2",), ("body",))]
    assert (applied.toast.from_source, applied.toast.missing_at_source) == (1, 1)


def test_a_key_update_after_a_change_left_out_takes_the_value_from_the_source(spark: SparkSession) -> None:
    """An update of key 1 is applied after key 1 became key 2 at the source; then the key update arrives."""
    target = MemoryTarget()
    source = FakeSource(rows={("2",): {"id": "2", "body": "kept", "score": "6"}})
    apply(spark, target, package([update(0x20, "1", U, "5")]), source=source)
    assert rows(target) == {}
    apply(spark, target, package([update(0x21, "2", U, "6", old_key=["1", None, None])]), source=source)
    assert rows(target) == {"2": ("2", "kept", "6")}


def test_without_a_source_an_unfillable_value_is_an_error_naming_the_table(spark: SparkSession) -> None:
    with pytest.raises(UnchangedValueError, match=r"public\.notes: 1 row\(s\) \(e\.g\. key \('1',\)\)"):
        apply(spark, MemoryTarget(), package([update(0x20, "1", U, "5")]))


def test_key_update_takes_unchanged_values_from_the_row_stored_under_the_old_key(spark: SparkSession) -> None:
    target = MemoryTarget()
    apply(spark, target, package([insert(0x10, "1", BIG, "1")]))
    apply(spark, target, package([update(0x20, "2", U, "1", old_key=["1", None, None])]))
    assert rows(target) == {"2": ("2", BIG, "1")}


def test_chained_key_updates_in_one_batch_follow_the_old_keys_history(spark: SparkSession) -> None:
    target = MemoryTarget()
    apply(spark, target, package([
        insert(0x10, "5", BIG, "1"),
        update(0x11, "6", U, "2", old_key=["5", None, None]),
        update(0x12, "7", U, "3", old_key=["6", None, None]),
        insert(0x13, "5", "reused key", "4"),  # a later row under the old key must not leak into 7
    ]))
    assert rows(target) == {"5": ("5", "reused key", "4"), "7": ("7", BIG, "3")}


def test_a_full_old_row_fills_unchanged_values_without_any_lookup(spark: SparkSession) -> None:
    target = MemoryTarget()
    applied = apply(spark, target, package([
        pb.Event(operation=pb.UPDATE, commit_lsn=0x20, position=1, commit_time_us=1,
                 new_row=pb.Row(tuple=encode_tuple(["1", U, "2"])), old_row=pb.Row(tuple=encode_tuple(["1", BIG, "1"])),
                 old_row_is_full=True),
    ]))
    assert rows(target) == {"1": ("1", BIG, "2")}
    assert applied.toast.total == 0


def test_truncate_drops_earlier_changes_and_keeps_later_ones(spark: SparkSession) -> None:
    target = MemoryTarget()
    apply(spark, target, package([insert(0x10, "1", "a", "1")]))
    applied = apply(spark, target, package([
        insert(0x20, "2", "b", "2"), truncate(0x21), insert(0x22, "3", "c", "3"), update(0x23, "3", "c2", "3"),
    ]))
    assert target.truncations == [naming.row_version(0x21, 1)]
    assert applied.rows == 1  # key 2 never reaches the target
    assert rows(target) == {"3": ("3", "c2", "3")}
    alone = apply(spark, target, package([truncate(0x30)]))
    assert (alone.rows, target.truncations[-1], rows(target)) == (0, naming.row_version(0x30, 1), {})


def test_columns_added_and_dropped_within_a_batch(spark: SparkSession) -> None:
    target = MemoryTarget()
    with_tag = (*NOTES, column("tag"))
    without_score = (NOTES[0], NOTES[1], column("tag"))
    source = FakeSource(rows={("2",): {"tag": "set later"}})
    apply(spark, target, package([insert(0x10, "1", "a", "1"), insert(0x10, "2", "b", "2", position=2)]),
          package([update(0x11, "1", "a", "1", "x")], columns=with_tag),
          package([update(0x12, "1", "a2", "x")], columns=without_score), source=source)
    assert [s.column_names for s in target.schemas] == [("id", "body", "tag")]
    # Key 2 was written under the old list: its new column is an unchanged value, read from the source.
    assert rows(target) == {"1": ("1", "a2", "x"), "2": ("2", "b", "set later")}


def test_a_corrupt_row_names_its_stream_sequence_and_lsn(spark: SparkSession) -> None:
    broken = package([insert(0x10, "1", "a", "1")])
    broken.events[0].new_row.tuple = broken.events[0].new_row.tuple[:-3]
    with pytest.raises(PythonException) as raised:  # raised on an executor
        apply(spark, MemoryTarget(), broken)
    assert "stream sequence 1, table public.notes, event at LSN 0/10 position 1: truncated TupleData" in str(raised.value)


def test_a_sliced_event_is_applied_once_reassembled(spark: SparkSession) -> None:
    target = MemoryTarget()
    apply(spark, target, *sliced(package([insert(0x10, "1", BIG, "1")]), 1000), package([update(0x11, "1", U, "2")]))
    assert rows(target) == {"1": ("1", BIG, "2")}


def test_an_old_key_without_primary_key_values_is_refused(spark: SparkSession) -> None:
    # REPLICA IDENTITY USING INDEX on other columns: the old key carries those, not the primary key.
    with pytest.raises(PythonException, match="event at LSN 0/10 position 1: the old key lacks primary key values"):
        apply(spark, MemoryTarget(), package([delete(0x10, None, "a", None)]))
