"""What a streaming run's targets share and save, without a server: the resync-shadow look-up a
stream write may reuse, siblings that share a ClickHouse client or a Snowflake session per thread,
and the embedded server's settings, put in force only when a request's differ from what is in force."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pytest

from siphon_core.config import ClickHouseTargetConfig, SnowflakeTargetConfig, StreamingConfig
from siphon_dagster.targets import clickhouse as clickhouse_module
from siphon_dagster.targets import sql_target
from siphon_dagster.targets.base import SourceColumn, TableSchema, change_batch_schema
from siphon_dagster.targets.clickhouse import ClickHouseTarget
from siphon_dagster.targets.snowflake import SnowflakeTarget
from siphon_dagster.targets.sql_target import ShadowLookups
from siphon_stack.clickhouse.engine import Connection

ITEMS = TableSchema("public", "items", (
    SourceColumn("id", 23, "integer", nullable=False, primary_key=True),
    SourceColumn("label", 25, "text"),
))


def batch(key: int) -> pa.Table:
    return pa.Table.from_arrays([pa.array([str(key)]), pa.array(["x"]), pa.array([key], pa.decimal128(38, 0)),
                                 pa.array([False])], schema=change_batch_schema(ITEMS))


def batch_of(rows: int, label: str = "x") -> pa.Table:
    return pa.Table.from_arrays([pa.array([str(i) for i in range(rows)]), pa.array([label] * rows),
                                 pa.array(range(rows), pa.decimal128(38, 0)), pa.array([False] * rows)],
                                schema=change_batch_schema(ITEMS))


class RecordingClickHouse(ClickHouseTarget):
    """A ClickHouse target whose statements are recorded instead of sent; the shadow exists when
    `shadow` says so."""

    def __init__(self, lookup_seconds: float) -> None:
        super().__init__(ClickHouseTargetConfig(url="http://127.0.0.1:1", database="db"))
        self.shadow_lookup_seconds = lookup_seconds
        self.shadow = False
        self.lookups = 0
        self.written: list[str] = []

    def _table_exists(self, names, name):  # noqa: ANN001, ANN202
        self.lookups += 1
        return self.shadow

    def _listed_shadows(self, names):  # noqa: ANN001, ANN202
        self.lookups += 1
        return {names.bare("shadow")} if self.shadow else set()

    def _write_batch(self, names, rows, targets):  # noqa: ANN001, ANN202
        self.written.append(",".join(targets))


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(sql_target.time, "monotonic", lambda: now[0])
    return now


def test_a_stream_write_reuses_its_shadow_lookup_for_the_configured_seconds(clock: list[float]) -> None:
    target = RecordingClickHouse(lookup_seconds=10.0)
    target.apply_rows(ITEMS, batch(1))
    clock[0] += 9.9
    target.shadow = True  # a resync started: the write within the window does not look again
    target.apply_rows(ITEMS, batch(2))
    clock[0] += 0.2
    target.apply_rows(ITEMS, batch(3))
    assert target.lookups == 2
    assert target.written == ["`db`.`public__items`", "`db`.`public__items`",
                              "`db`.`public__items__resync`,`db`.`public__items`"]


def test_without_a_window_every_stream_write_looks_for_the_shadow(clock: list[float]) -> None:
    target = RecordingClickHouse(lookup_seconds=0.0)
    for key in range(3):
        target.apply_rows(ITEMS, batch(key))
    assert target.lookups == 3


def test_a_resync_waits_out_the_streams_window_before_its_first_snapshot(monkeypatch) -> None:
    from siphon_core.config import TableConfig
    from siphon_dagster import resync
    from siphon_dagster.specs import TableSpec

    slept: list[float] = []
    monkeypatch.setattr(resync.time, "sleep", slept.append)
    spec = TableSpec("app", TableConfig(name="public.items"), ("clickhouse",), StreamingConfig(shadow_lookup_seconds=4.0))
    said: list[str] = []
    resync._wait_for_streaming_runs(spec, said.append)  # noqa: SLF001
    assert slept and slept[0] > 4.0 and "streaming.shadow_lookup_seconds" in said[0]
    slept.clear()
    resync._wait_for_streaming_runs(TableSpec("app", TableConfig(name="public.items"), ("clickhouse",),  # noqa: SLF001
                                              StreamingConfig(shadow_lookup_seconds=0)), said.append)
    assert slept == []  # streams that look before every write need no wait


class FakeClient:
    def __init__(self, settings: dict[str, Any] | None) -> None:
        self.settings = settings
        self.closed = False
        self.thread = threading.get_ident()

    def command(self, statement: str, **kwargs: Any) -> str:
        return f"{statement} on {id(self)}"

    def close(self) -> None:
        self.closed = True


def test_siblings_share_one_client_per_thread_and_the_first_target_closes_them(monkeypatch) -> None:
    opened: list[FakeClient] = []

    def fake_open(self: ClickHouseTarget, settings: dict[str, Any] | None = None) -> FakeClient:
        opened.append(FakeClient(settings))
        return opened[-1]

    monkeypatch.setattr(ClickHouseTarget, "_open", fake_open)
    first = ClickHouseTarget(ClickHouseTargetConfig(url="http://127.0.0.1:1", database="db"))
    first.shadow_lookup_seconds = 7.0
    siblings = [first.sibling() for _ in range(50)]
    assert all(s.shadow_lookup_seconds == 7.0 for s in siblings)
    answers = [s._connect().command("SELECT 1") for s in siblings]  # noqa: SLF001
    other: list[str] = []
    worker = threading.Thread(target=lambda: other.append(siblings[3]._connect().command("SELECT 1")))  # noqa: SLF001
    worker.start()
    worker.join()
    assert len(set(answers)) == 1 and other[0] != answers[0]  # one client per thread, not per table
    assert len(opened) == 2 and all(c.settings == clickhouse_module.BATCH_INSERT_SETTINGS for c in opened)
    siblings[0].close()
    assert not any(c.closed for c in opened)  # a sibling leaves the shared clients open
    first.close()
    assert all(c.closed for c in opened)


def test_a_small_change_batch_is_inserted_on_one_thread_and_a_large_one_on_two(monkeypatch) -> None:
    inserted: list[tuple[str, int, dict[str, Any]]] = []

    class InsertingClient(FakeClient):
        def raw_insert(self, table: str, column_names: list[str], insert_block: Any, settings: dict[str, Any],
                       fmt: str) -> None:
            inserted.append((table, len(insert_block), settings))

    monkeypatch.setattr(ClickHouseTarget, "_open", lambda self, settings=None: InsertingClient(settings))
    target = ClickHouseTarget(ClickHouseTargetConfig(url="http://127.0.0.1:1", database="db"))
    names = target._names(ITEMS)  # noqa: SLF001
    small = clickhouse_module.SMALL_BATCH_ROWS
    for rows in (1, small, small + 1):
        target._write_batch(names, batch_of(rows), [names.live])  # noqa: SLF001
    assert [settings["max_threads"] for _, _, settings in inserted] == [1, 1, 2]
    assert [settings["max_insert_threads"] for _, _, settings in inserted] == [1, 1, 2]
    assert all(settings["optimize_on_insert"] == 0 and settings["input_format_null_as_default"] == 1
               and table == names.live for table, _, settings in inserted)


def test_a_small_change_batch_carries_its_statement_in_its_body_and_a_large_one_in_the_url(monkeypatch) -> None:
    # The driver puts the statement in front of a body given as bytes, and in the URL otherwise; a
    # large batch goes as its Arrow stream's pieces, with their length.
    blocks: list[tuple[Any, dict[str, str] | None]] = []

    class InsertingClient(FakeClient):
        def raw_insert(self, table: str, column_names: list[str], insert_block: Any, settings: dict[str, Any],
                       fmt: str, transport_settings: dict[str, str] | None = None) -> None:
            blocks.append((insert_block, transport_settings))

    monkeypatch.setattr(ClickHouseTarget, "_open", lambda self, settings=None: InsertingClient(settings))
    target = ClickHouseTarget(ClickHouseTargetConfig(url="http://127.0.0.1:1", database="db"))
    names = target._names(ITEMS)  # noqa: SLF001
    for value, rows in (("x", 10), ("y" * 100, 20_000)):
        target._write_batch(names, batch_of(rows, value), [names.live])  # noqa: SLF001
    (small, small_transport), (pieces, transport) = blocks
    assert isinstance(small, bytes) and len(small) <= clickhouse_module.INLINE_STATEMENT_MAX_BYTES
    assert small_transport is None
    large = b"".join(pieces)
    assert isinstance(pieces, list) and len(pieces) > 1
    assert len(large) > clickhouse_module.INLINE_STATEMENT_MAX_BYTES
    assert transport == {"Content-Length": str(len(large))}
    for block, rows in ((small, 10), (large, 20_000)):  # either way the whole Arrow stream
        assert pa.ipc.open_stream(pa.py_buffer(block)).read_all().num_rows == rows


class FakeSession:
    def __init__(self) -> None:
        self.closed = False

    def is_closed(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def test_snowflake_siblings_share_a_session_per_thread_and_a_session_that_ended_is_replaced(monkeypatch) -> None:
    opened: list[FakeSession] = []

    def fake_open(self: SnowflakeTarget) -> FakeSession:
        opened.append(FakeSession())
        return opened[-1]

    monkeypatch.setattr(SnowflakeTarget, "_open", fake_open)
    first = SnowflakeTarget(SnowflakeTargetConfig(account="a", user="u", password="p", database="d", schema="s"))
    first.shadow_lookup_seconds = 3.0
    siblings = [first.sibling() for _ in range(50)]
    assert all(s.shadow_lookup_seconds == 3.0 and s.config is first.config for s in siblings)
    sessions = {id(s._connect()) for s in siblings}  # noqa: SLF001
    siblings[0]._session()["load_stage"] = "stage_a"  # noqa: SLF001 - what the first stage load leaves
    other: list[Any] = []
    worker = threading.Thread(target=lambda: other.extend([siblings[7]._connect(), siblings[7]._session()]))  # noqa: SLF001
    worker.start()
    worker.join()
    assert len(sessions) == 1 and id(other[0]) not in sessions and other[1] == {}  # one per thread, not per table
    assert siblings[9]._session() == {"load_stage": "stage_a"}  # noqa: SLF001 - the thread's session, any table
    # A session that ended (a dropped connection, an expiry) is opened anew, without its stage.
    opened[0].closed = True
    assert siblings[3]._connect() is opened[2] and siblings[3]._session() == {}  # noqa: SLF001
    siblings[0].close()
    assert not opened[2].closed and not opened[1].closed  # a sibling leaves the shared sessions open
    first.close()
    assert all(session.closed for session in opened)
    assert siblings[0]._connect() is opened[3]  # noqa: SLF001 - a statement after the close opens one again


def test_a_run_of_several_tables_decodes_its_batches_itself_unless_configured() -> None:
    assert StreamingConfig().driver_decode_limit(1) == 1_000_000
    assert StreamingConfig().driver_decode_limit(200) == 2 * StreamingConfig().batch_max_bytes
    assert StreamingConfig(driver_decode_max_bytes=0).driver_decode_limit(200) == 0
    # A Spark Connect server decodes large batches of every run: they would sit in the run's memory.
    assert StreamingConfig().driver_decode_limit(200, remote_spark=True) == 1_000_000
    assert StreamingConfig(driver_decode_max_bytes=5).driver_decode_limit(200, remote_spark=True) == 5


class _Result:
    def __init__(self, text: str) -> None:
        self._text = text

    def bytes(self) -> bytes:
        return self._text.encode()


class RecordingEngineConnection:
    """chdb's connection as the engine's `Connection` uses it: the session's settings, and every
    statement run."""

    def __init__(self) -> None:
        self.statements: list[str] = []
        self.values = {"max_threads": "auto(2)", "optimize_on_insert": "1"}

    def query(self, sql: str, output_format: str, params: dict | None = None) -> _Result:
        if sql.startswith("SELECT name, value FROM system.settings"):
            import json

            return _Result("\n".join(json.dumps({"name": n, "value": v}) for n, v in self.values.items()))
        self.statements.append(sql)
        return _Result("")


def test_the_embedded_server_sets_only_settings_that_differ_from_those_in_force() -> None:
    raw = RecordingEngineConnection()
    connection = Connection(raw, keeps_state=True)
    batch_settings = {"max_threads": "2", "optimize_on_insert": "0"}
    connection.prepare(None, batch_settings, "INSERT")
    connection.prepare(None, batch_settings, "INSERT")
    assert [s for s in raw.statements if s.startswith("SET")] == ["SET max_threads = '2', optimize_on_insert = '0'"]
    raw.statements.clear()
    # A request without them gets the session's values back, in one statement; the same request again sets nothing.
    connection.prepare(None, {}, "SELECT")
    connection.prepare(None, {}, "SELECT")
    assert raw.statements == ["SET max_threads = 'auto(2)', optimize_on_insert = '1'"]
    raw.statements.clear()
    # A value equal to the session's own is already in force.
    connection.prepare(None, {"optimize_on_insert": "1"}, "SELECT")
    assert raw.statements == []
    # After a SET statement nothing is known to be in force: the next override is set again.
    connection.prepare(None, {}, "SET")
    connection.finish("SET")
    connection.prepare(None, batch_settings, "INSERT")
    assert [s for s in raw.statements if s.startswith("SET")] == ["SET max_threads = '2', optimize_on_insert = '0'"]


def test_siblings_answer_every_tables_resync_lookup_with_one_listing() -> None:
    lookups = ShadowLookups()
    listings: list[int] = []

    def list_all() -> set[str]:
        listings.append(1)
        return {"public__b__resync"}

    def one_by_one() -> bool:
        raise AssertionError("a target that lists its resync tables never looks one up")

    answers = [lookups.exists(f"public__{t}__resync", 60.0, one_by_one, list_all) for t in "abcab"]
    assert answers == [False, True, False, False, True] and len(listings) == 1
    lookups.gone("public__b__resync")  # a write found it dropped
    assert not lookups.exists("public__b__resync", 60.0, one_by_one, list_all) and len(listings) == 1
    time.sleep(0.02)
    assert lookups.exists("public__b__resync", 0.01, one_by_one, list_all) and len(listings) == 2


def test_a_target_that_cannot_list_looks_up_each_table_once_per_interval() -> None:
    lookups = ShadowLookups()
    asked: list[str] = []

    def look_up(name: str) -> Callable[[], bool]:
        return lambda: asked.append(name) or name == "b"

    answers = [lookups.exists(t, 60.0, look_up(t), lambda: None) for t in "abab"]
    assert answers == [False, True, False, True] and asked == ["a", "b"]
    lookups.gone("b")
    assert not lookups.exists("b", 60.0, look_up("b"), lambda: None) and asked == ["a", "b"]
