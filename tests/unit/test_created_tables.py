"""`CreatedTables`: a group run's tables made by the stream are asked about together, and none of
their batches is handed on (to be materialized) before the answer."""

from collections.abc import Sequence

import pytest

from siphon_dagster.streaming.created_tables import CHUNK, CreatedTables
from siphon_dagster.streaming.report import BatchReport


def report(table: str, sequence: int, created: bool = False) -> BatchReport:
    return BatchReport(target="clickhouse", table=table, first_sequence=sequence, last_sequence=sequence,
                       messages=1, events=1, rows_by_operation={"insert": 1}, rows_applied=1, applied_lsn=sequence,
                       latency_seconds=0.1, lag_oldest_seconds=0.1, lag_newest_seconds=0.1, pending=0,
                       created_table=created)


def test_made_tables_wait_with_their_reports_and_are_answered_in_one_read_per_chunk() -> None:
    asked: list[list[str]] = []

    def materialized(tables: Sequence[str]) -> set[str]:
        asked.append(list(tables))
        return {table for table in tables if table.startswith("old")}

    created = CreatedTables(materialized)
    assert created.answer().reports == [] and asked == []  # nothing held: nothing asked
    assert not created.hold(report("quiet", 1))  # an existing table's batch goes on at once
    assert created.hold(report("new", 2, created=True))
    assert created.hold(report("old", 3, created=True))
    assert created.hold(report("new", 4))  # a later batch of a table waiting for its answer
    assert created.hold(report("twice", 5, created=True))
    assert created.hold(report("twice", 6, created=True))  # made again after the first made it
    answered = created.answer()
    assert asked == [["new", "old", "twice"]]
    assert answered.new == ["new"]
    assert answered.made_again == ["old", "twice"]
    assert [r.first_sequence for r in answered.reports] == [2, 3, 4, 5, 6]  # in the order they came
    # Answered: the table's next batches go on, and nothing is asked again.
    assert not created.hold(report("new", 7))
    assert created.answer().reports == [] and len(asked) == 1


def test_hundreds_of_made_tables_are_asked_for_a_chunk_at_a_time() -> None:
    asked: list[int] = []

    def materialized(tables: Sequence[str]) -> set[str]:
        asked.append(len(tables))
        return set()

    created = CreatedTables(materialized)
    for index in range(CHUNK * 2 + 7):
        created.hold(report(f"t{index}", index, created=True))
    answered = created.answer()
    assert asked == [CHUNK, CHUNK, 7]
    assert len(answered.new) == CHUNK * 2 + 7 and answered.made_again == []


def test_a_read_that_fails_leaves_every_report_held_for_the_next_tick() -> None:
    failing = [True]

    def materialized(tables: Sequence[str]) -> set[str]:
        if failing[0]:
            raise OSError("storage unreachable")
        return set(tables)

    created = CreatedTables(materialized)
    created.hold(report("t", 1, created=True))
    with pytest.raises(OSError):
        created.answer()
    failing[0] = False
    assert created.hold(report("t", 2))  # still waiting for its answer
    answered = created.answer()
    assert answered.made_again == ["t"] and [r.first_sequence for r in answered.reports] == [1, 2]
