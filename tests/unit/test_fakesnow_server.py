"""The fakesnow launcher keeps a bounded number of query results."""

from __future__ import annotations

from fakesnow.instance import FakeSnow

from siphon_stack.fakesnow_server import RESULTS_KEPT, RecentResults, TableWriteLocks, bound_results


def test_recent_results_keep_the_latest_entries_in_order_of_writing() -> None:
    results = RecentResults(limit=3)
    for key in "abcd":
        results[key] = key.upper()
    assert list(results) == ["b", "c", "d"]
    results["b"] = "again"  # written again: now the most recent
    results["e"] = "E"
    assert list(results) == ["d", "b", "e"] and results["b"] == "again"
    assert results.get("a") is None


def test_instances_made_after_bounding_share_a_bounded_cache() -> None:
    undo = bound_results()
    try:
        instance = FakeSnow()
        assert isinstance(instance.results_cache, RecentResults) and instance.results_cache.limit == RESULTS_KEPT
    finally:
        undo()
    assert not isinstance(FakeSnow().results_cache, RecentResults)


def test_statements_that_change_a_table_share_that_tables_lock() -> None:
    locks = TableWriteLocks()
    merge = locks.lock_for('MERGE INTO "SIPHON"."PUBLIC"."odd ""name""" AS t USING (SELECT 1) AS s ON TRUE '
                           "WHEN MATCHED THEN DELETE")
    assert merge is not None
    assert locks.lock_for('  update "SIPHON"."PUBLIC"."odd ""name""" SET x = 1') is merge
    assert locks.lock_for('DELETE FROM siphon.public."odd ""name"""') is merge  # unquoted parts fold to upper case
    assert locks.lock_for('UPDATE "SIPHON"."PUBLIC"."Odd ""name""" SET x = 1') is not merge  # quoted parts do not
    for other in ("SELECT * FROM t", 'INSERT INTO "T" VALUES (1)', "COPY INTO t FROM @s", "CREATE TABLE t (x INT)"):
        assert locks.lock_for(other) is None
