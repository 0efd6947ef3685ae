"""The local stack's fakesnow runs the statements that change one table one at a time, as
Snowflake does (`siphon_stack.fakesnow_server.serialize_table_writes`).

fakesnow runs a MERGE as statements of its own: the rows to change are chosen into a table, then
updated from it. Here the first MERGE is held for a moment right after it chose its rows, so that
a second session's MERGE of the same row falls in between, as it did in a demo by chance: without
the table's lock, the first MERGE writes its older row over the newer one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fakesnow.cursor import FakeSnowflakeCursor
from fakesnow.instance import FakeSnow
from sqlglot import exp

from siphon_stack.fakesnow_server import serialize_table_writes

MERGE = ('MERGE INTO "T" AS t USING (SELECT {id} AS id, {version} AS v, \'{body}\' AS body) AS s ON t.id = s.id '
         "WHEN MATCHED AND s.v > t.v THEN UPDATE SET v = s.v, body = s.body "
         "WHEN NOT MATCHED THEN INSERT (id, v, body) VALUES (s.id, s.v, s.body)")


@pytest.fixture
def held_after_choosing(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set when a MERGE run on a thread named `held` has chosen its rows; it then waits 0.5 s."""
    chosen = threading.Event()
    run = FakeSnowflakeCursor._execute  # noqa: SLF001

    def execute(self: FakeSnowflakeCursor, transformed: exp.Expr, params: Any = None) -> None:
        run(self, transformed, params)
        if threading.current_thread().name == "held" and isinstance(transformed, exp.Create) \
                and "merge_candidates" in transformed.sql().lower():
            chosen.set()
            time.sleep(0.5)

    monkeypatch.setattr(FakeSnowflakeCursor, "_execute", execute)
    return chosen


@pytest.fixture
def serialized() -> Iterator[None]:
    undo = serialize_table_writes()
    yield
    undo()


def merge_beside_another(chosen: threading.Event) -> list[tuple]:
    instance = FakeSnow()
    older, newer = instance.connect("DB", "S"), instance.connect("DB", "S")  # two sessions
    older.cursor().execute('CREATE TABLE "T" (id INT, v INT, body VARCHAR)')
    older.cursor().execute("""INSERT INTO "T" VALUES (1, 1, 'first')""")
    held = threading.Thread(name="held", target=lambda: older.cursor().execute(
        MERGE.format(id=1, version=5, body="snapshot")))
    held.start()
    assert chosen.wait(10)
    newer.cursor().execute(MERGE.format(id=1, version=9, body="stream"))
    held.join(10)
    return newer.cursor().execute('SELECT id, v, body FROM "T" ORDER BY v').fetchall()


def test_a_merge_of_a_table_waits_for_another_sessions_merge_of_it(serialized: None,
                                                                   held_after_choosing: threading.Event) -> None:
    assert merge_beside_another(held_after_choosing) == [(1, 9, "stream")]


def test_without_the_lock_fakesnow_writes_the_older_row_over_the_newer(held_after_choosing: threading.Event) -> None:
    # What the lock is for: this is the fake's own behaviour, not Snowflake's.
    assert merge_beside_another(held_after_choosing) == [(1, 5, "snapshot")]
