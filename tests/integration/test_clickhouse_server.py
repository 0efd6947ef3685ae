"""The embedded ClickHouse server (`siphon-clickhouse`) as clickhouse-connect, curl and many processes
use it: a real subprocess on a loopback port, as in the local stack."""

from __future__ import annotations

import datetime as dt
import decimal
import json
import multiprocessing
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import clickhouse_connect
import numpy as np
import pandas as pd
import pytest
from clickhouse_connect.driver.exceptions import DatabaseError
from clickhouse_connect.driver.external import ExternalData

from tests.integration.clickhouse_fixtures import (
    EmbeddedClickHouse,
    embedded_clickhouse_fixture,  # noqa: F401 - provides the embedded_clickhouse fixture
    running_server,
)

pytestmark = pytest.mark.integration

MILLION = 1_000_000


def http(
    server: EmbeddedClickHouse,
    body: bytes | str | None = None,
    params: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
    path: str = "/",
) -> tuple[int, dict[str, str], bytes]:
    """A plain HTTP request, as curl would send it: (status, headers, body)."""
    url = server.url + path + ("?" + urllib.parse.urlencode(params) if params else "")
    data = body.encode() if isinstance(body, str) else body
    request = urllib.request.Request(url, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def test_answers_like_a_clickhouse_server(embedded_clickhouse: EmbeddedClickHouse) -> None:
    assert http(embedded_clickhouse, path="/ping")[2] == b"Ok.\n"
    assert http(embedded_clickhouse)[2] == b"Ok.\n"
    client = embedded_clickhouse.client()
    version, timezone = client.command("SELECT version(), timezone()")
    assert client.server_version == version

    status, headers, body = http(embedded_clickhouse, "SELECT 1 AS x FORMAT JSONEachRow", {"query_id": "q-1"})
    assert (status, json.loads(body)) == (200, {"x": 1})
    assert headers["X-ClickHouse-Format"] == "JSONEachRow"
    assert headers["X-ClickHouse-Query-Id"] == "q-1"
    assert headers["X-ClickHouse-Timezone"] == timezone
    assert json.loads(headers["X-ClickHouse-Summary"])["result_rows"] == "1"


def test_a_million_rows_round_trip_through_native(embedded_clickhouse: EmbeddedClickHouse) -> None:
    client = embedded_clickhouse.client()
    client.command(
        "CREATE TABLE million (id UInt64, value Float64, name String, flag Nullable(UInt8)) "
        "ENGINE = MergeTree ORDER BY id"
    )
    ids = np.arange(MILLION, dtype=np.uint64)
    names = [f"name-{i}" for i in range(MILLION)]
    flags = pd.array([None if i % 10 == 0 else i % 2 for i in range(MILLION)], dtype="UInt8")
    frame = pd.DataFrame({"id": ids, "value": ids / 3, "name": names, "flag": flags})

    started = time.monotonic()
    assert client.insert_df("million", frame).written_rows == MILLION
    inserted = time.monotonic() - started

    expected_hash = client.command(f"SELECT sum(cityHash64(concat('name-', toString(number)))) FROM numbers({MILLION})")
    figures = client.query("SELECT count(), sum(id), sum(cityHash64(name)), countIf(flag IS NULL) FROM million")
    assert figures.result_rows[0] == (MILLION, MILLION * (MILLION - 1) // 2, expected_hash, MILLION // 10)

    started = time.monotonic()
    back = client.query_df("SELECT * FROM million ORDER BY id")
    read = time.monotonic() - started
    assert np.array_equal(back["id"].to_numpy(), ids)
    assert np.array_equal(back["value"].to_numpy(), ids / 3)
    assert back["name"].tolist() == names
    assert int(back["flag"].isna().sum()) == MILLION // 10
    print(f"\n1,000,000 rows: insert_df (Native) {inserted:.2f}s, query_df (Native) {read:.2f}s")


TYPED_COLUMNS = (
    "id UInt32, n Nullable(Int64), lc LowCardinality(String), tags Array(String), "
    "maybe Array(Nullable(UInt8)), amount Decimal(38, 10), big UInt128, at DateTime64(6, 'UTC'), "
    "day Date32, attributes Map(String, UInt16)"
)


def _typed_rows() -> list[list[object]]:
    start = dt.datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=dt.UTC)
    return [
        [
            i,
            None if i % 3 == 0 else -(10**15) * i,
            f"label-{i % 4}",
            [f"t{j}" for j in range(i % 3)],
            [None if j % 2 else j for j in range(i % 4)],
            decimal.Decimal(f"-{i}.0123456789") if i % 2 else decimal.Decimal(f"{i}e20"),
            2**128 - 1 - i,
            start + dt.timedelta(days=i * 400, microseconds=i),
            dt.date(1900, 1, 1) + dt.timedelta(days=i * 1000),
            {f"k{i}": i, "common": 7},
        ]
        for i in range(50)
    ]


def _normalised(rows: list) -> list[list[object]]:
    """Timestamps as aware UTC values, whichever way the client returned them."""
    return [
        [value.replace(tzinfo=dt.UTC) if isinstance(value, dt.datetime) and value.tzinfo is None else value
         for value in row]
        for row in rows
    ]  # fmt: skip


def test_nullable_array_decimal_uint128_datetime64_round_trip(embedded_clickhouse: EmbeddedClickHouse) -> None:
    client = embedded_clickhouse.client()
    client.command(f"CREATE TABLE typed ({TYPED_COLUMNS}) ENGINE = MergeTree ORDER BY id")
    rows = _typed_rows()
    client.insert("typed", rows)
    assert _normalised(client.query("SELECT * FROM typed ORDER BY id").result_rows) == rows

    # Arrow both ways: query_arrow reads FORMAT Arrow, insert_arrow sends it back.
    client.command(f"CREATE TABLE typed_arrow ({TYPED_COLUMNS}) ENGINE = MergeTree ORDER BY id")
    client.insert_arrow("typed_arrow", client.query_arrow("SELECT * FROM typed"))
    assert _normalised(client.query("SELECT * FROM typed_arrow ORDER BY id").result_rows) == rows


def test_query_parameters_are_bound_by_the_server(embedded_clickhouse: EmbeddedClickHouse) -> None:
    client = embedded_clickhouse.client()
    text = "tab\there, 'quotes', back\\slash and ünïcode"
    values = {
        "s": text,
        "a": ["x", "y'z"],
        "d": dt.datetime(2024, 5, 6, 7, 8, 9, 123000),
        "n": None,
        "dec": decimal.Decimal("12.34"),
    }
    row = client.query(
        "SELECT {s:String}, {a:Array(String)}, {d:DateTime64(3)}, {n:Nullable(Int32)}, {dec:Decimal(10, 2)}",
        parameters=values,
    ).result_rows[0]
    assert row == (text, ["x", "y'z"], values["d"], None, values["dec"])
    client.command("CREATE TABLE IF NOT EXISTS one_row (x UInt8) ENGINE = Memory AS SELECT 1")
    assert client.command("SELECT count() FROM {t:Identifier}", parameters={"t": "one_row"}) == 1
    # Parameters too long for a URL travel in a multipart form.
    assert client.command("SELECT length({long:String})", parameters={"long": "x" * 20000}) == 20000


def test_settings_apply_to_their_query(embedded_clickhouse: EmbeddedClickHouse) -> None:
    client = embedded_clickhouse.client()
    assert client.command("SELECT getSetting('max_block_size')", settings={"max_block_size": 1234}) == 1234
    assert client.command("SELECT getSetting('max_block_size')") != 1234
    with pytest.raises(DatabaseError) as raised:
        client.query("SELECT number FROM numbers(10)", settings={"max_result_rows": 5, "result_overflow_mode": "throw"})
    assert "TOO_MANY_ROWS_OR_BYTES" in str(raised.value)


def test_a_session_keeps_temporary_tables_use_and_set(embedded_clickhouse: EmbeddedClickHouse) -> None:
    client = embedded_clickhouse.client()
    client.command("CREATE TEMPORARY TABLE scratch (x UInt8)")
    client.command("INSERT INTO scratch VALUES (1), (2), (3)")
    assert client.command("SELECT sum(x) FROM scratch") == 6

    default = client.command("SELECT getSetting('max_block_size')")
    assert client.command("SELECT getSetting('max_block_size')", settings={"max_block_size": 5}) == 5
    assert client.command("SELECT getSetting('max_block_size')") == default
    # The session's value a request override returns to is the one SET gave it, not the one before.
    client.command("SET max_block_size = 777")
    assert client.command("SELECT getSetting('max_block_size')") == 777
    assert client.command("SELECT getSetting('max_block_size')", settings={"max_block_size": 5}) == 5
    assert client.command("SELECT getSetting('max_block_size')") == 777

    client.command("CREATE DATABASE IF NOT EXISTS elsewhere")
    client.command("USE elsewhere")
    assert client.command("SELECT currentDatabase()") == "elsewhere"

    other = embedded_clickhouse.client()
    assert other.command("SELECT currentDatabase()") == "default"
    assert other.command("EXISTS TEMPORARY TABLE scratch") == 0
    assert embedded_clickhouse.client(database="elsewhere").command("SELECT currentDatabase()") == "elsewhere"


def test_a_session_serves_one_request_at_a_time(embedded_clickhouse: EmbeddedClickHouse) -> None:
    params = {"session_id": "busy-session"}
    slow = threading.Thread(target=http, args=(embedded_clickhouse, "SELECT sleep(1.5)", params))
    slow.start()
    time.sleep(0.5)
    status, headers, body = http(embedded_clickhouse, "SELECT 1", params)
    slow.join()
    assert (status, headers["X-ClickHouse-Exception-Code"]) == (500, "373")
    assert b"SESSION_IS_LOCKED" in body


def test_an_idle_session_expires(embedded_clickhouse: EmbeddedClickHouse) -> None:
    params = {"session_id": "short-lived", "session_timeout": "1"}
    assert http(embedded_clickhouse, "CREATE TEMPORARY TABLE scratch (x UInt8)", params)[0] == 200
    assert http(embedded_clickhouse, "EXISTS TEMPORARY TABLE scratch", params)[2] == b"1\n"
    time.sleep(2.5)
    status, headers, _ = http(embedded_clickhouse, "SELECT 1", {**params, "session_check": "1"})
    assert (status, headers["X-ClickHouse-Exception-Code"]) == (500, "372")


def test_bad_sql_raises_database_error_with_clickhouse_text(embedded_clickhouse: EmbeddedClickHouse) -> None:
    client = embedded_clickhouse.client()
    with pytest.raises(DatabaseError) as raised:
        client.query("SELEC 1")
    assert raised.value.code == 62
    assert "Code: 62. DB::Exception: Syntax error" in str(raised.value)
    assert "(SYNTAX_ERROR)" in str(raised.value)

    status, headers, body = http(embedded_clickhouse, "SELECT * FROM no_such_table")
    assert (status, headers["X-ClickHouse-Exception-Code"]) == (404, "60")
    assert body.startswith(b"Code: 60. DB::Exception: ") and b"(UNKNOWN_TABLE)" in body

    # An error after the first block reaches the client inside the stream, as ClickHouse 25.11+ sends
    # it; clickhouse-connect reads the result lazily and raises on first access.
    result = client.query("SELECT throwIf(number = 300000) FROM numbers(1000000) SETTINGS max_block_size = 1000")
    with pytest.raises(DatabaseError, match="FUNCTION_THROW_IF_VALUE_IS_NON_ZERO"):
        _ = result.result_rows
    assert client.command("SELECT 1") == 1


@pytest.mark.parametrize("compression", ["lz4", "zstd", "gzip"])
def test_compressed_inserts(embedded_clickhouse: EmbeddedClickHouse, compression: str) -> None:
    client = embedded_clickhouse.client(compress=compression)
    table = f"compressed_{compression}"
    client.command(f"CREATE TABLE {table} (id UInt64, text String) ENGINE = MergeTree ORDER BY id")
    client.insert(table, [list(range(200_000)), ["z" * (i % 40) for i in range(200_000)]],
                  column_names=["id", "text"], column_oriented=True)  # fmt: skip
    figures = client.query(f"SELECT count(), sum(id), sum(length(text)) FROM {table}").result_rows[0]
    assert figures == (200_000, 200_000 * 199_999 // 2, sum(i % 40 for i in range(200_000)))


def test_plain_http_formats_for_curl_users(embedded_clickhouse: EmbeddedClickHouse) -> None:
    server = embedded_clickhouse
    assert http(server, "CREATE TABLE plain (id UInt32, word String) ENGINE = MergeTree ORDER BY id")[0] == 200
    assert http(server, "INSERT INTO plain FORMAT CSV\n1,one\n2,two\n")[0] == 200
    assert http(server, "3\tthree\n", {"query": "INSERT INTO plain FORMAT TabSeparated"})[0] == 200
    assert http(server, '{"id": 4, "word": "four"}\n', {"query": "INSERT INTO plain (id, word) FORMAT JSONEachRow"})[0] == 200
    assert http(server, "INSERT INTO plain VALUES (5, 'five'), (6, 'six')")[0] == 200

    assert http(server, "SELECT * FROM plain ORDER BY id FORMAT CSV")[2].splitlines()[-1] == b'6,"six"'
    document = json.loads(http(server, "SELECT count() AS rows FROM plain FORMAT JSON")[2])
    assert document["data"] == [{"rows": 6}]
    assert http(server, "SELECT word FROM plain WHERE id = 3", {"default_format": "JSONEachRow"})[2] == b'{"word":"three"}\n'
    assert http(server, params={"query": "SELECT max(id) FROM plain"})[2] == b"6\n"

    status, headers, body = http(server, params={"query": "DROP TABLE plain"})  # GET implies readonly
    assert (status, headers["X-ClickHouse-Exception-Code"]) == (500, "164")


def test_command_data_raw_insert_and_external_data(embedded_clickhouse: EmbeddedClickHouse) -> None:
    client = embedded_clickhouse.client()
    client.command("CREATE TABLE fed (id UInt8, word String) ENGINE = MergeTree ORDER BY id")
    client.command("INSERT INTO fed FORMAT CSV", data="1,one\n")
    client.command("INSERT INTO fed FORMAT JSONEachRow", data=b'{"id": 2, "word": "two"}\n')
    client.raw_insert("fed", ["id", "word"], insert_block="3\tthree\n", fmt="TabSeparated")
    assert client.query("SELECT * FROM fed ORDER BY id").result_rows == [(1, "one"), (2, "two"), (3, "three")]

    lookup = ExternalData(file_name="lookup.csv", data=b"2,deux\n3,trois\n", fmt="CSV", structure="id UInt8, fr String")
    joined = client.query("SELECT word, fr FROM fed JOIN lookup USING id ORDER BY id", external_data=lookup)
    assert joined.result_rows == [("two", "deux"), ("three", "trois")]


def _worker(port: int, worker: int) -> tuple[int, int]:
    """One process of several: its own table, written and read in rounds, plus a shared table."""
    client = clickhouse_connect.get_client(host="127.0.0.1", port=port)
    table = f"worker_{worker}"
    client.command(f"CREATE TABLE {table} (id UInt64, text String) ENGINE = MergeTree ORDER BY id")
    for round_number in range(3):
        ids = list(range(round_number * 100_000, (round_number + 1) * 100_000))
        client.insert(table, [ids, [str(i) for i in ids]], column_names=["id", "text"], column_oriented=True)
        rows = (round_number + 1) * 100_000
        assert client.query(f"SELECT count(), sum(id) FROM {table}").result_rows[0] == (rows, rows * (rows - 1) // 2)
        assert len(client.query_df(f"SELECT * FROM {table}")) == rows
    client.command(f"INSERT INTO shared SELECT number, {worker} FROM numbers(50000)")
    return worker, int(client.command(f"SELECT count() FROM {table}"))


def test_many_processes_at_once(embedded_clickhouse: EmbeddedClickHouse) -> None:
    client = embedded_clickhouse.client()
    client.command("CREATE TABLE shared (id UInt64, worker UInt8) ENGINE = MergeTree ORDER BY id")
    pool = multiprocessing.get_context("spawn").Pool(4)
    try:
        results = pool.starmap_async(_worker, [(embedded_clickhouse.port, worker) for worker in range(4)]).get(300)
    finally:
        # The workers end on their own once their tasks are done. The context manager would kill
        # them instead (terminate), and once, on a loaded machine, waited forever on one of them.
        pool.close()
        pool.join()
    assert sorted(results) == [(worker, 300_000) for worker in range(4)]
    per_worker = client.query("SELECT worker, count() FROM shared GROUP BY worker ORDER BY worker").result_rows
    assert per_worker == [(worker, 50_000) for worker in range(4)]


def test_restart_keeps_data_and_a_second_server_is_refused(tmp_path: Path) -> None:
    servers = running_server(tmp_path)
    server = next(servers)
    server.client().command("CREATE TABLE kept (id UInt64) ENGINE = MergeTree ORDER BY id")
    server.client().command("INSERT INTO kept SELECT number FROM numbers(1000)")
    # The engine's start-up settings travel beside the directory's name, never in it.
    assert (tmp_path / "data" / "metadata").is_dir()
    assert [entry.name for entry in tmp_path.iterdir() if "?" in entry.name] == []

    second = subprocess.run(server.argv(port=server.port + 1), capture_output=True, text=True, timeout=60)
    assert second.returncode == 1
    assert "in use by another process" in second.stderr and f"PID: {server.pid}" in second.stderr

    server.stop()
    server.start()
    try:
        assert server.client().command("SELECT count(), sum(id) FROM kept") == ["1000", "499500"]
    finally:
        servers.close()
