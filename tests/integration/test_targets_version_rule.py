"""The version rule at every target: the same scenarios, applied through the Target interface, for
ClickHouse (embedded server) and Snowflake (fakesnow server), the latter loading every batch once
with INSERT into a staging table (`snowflake`), once as the VALUES of its MERGE (`snowflake_values`)
and once through a stage and COPY (`snowflake_stage`).

A scenario is a list of steps, each a change batch, a snapshot (COPY text) or a truncate, followed
by the current rows the target must show, as PostgreSQL text.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pyarrow as pa
import pytest

from siphon_core.config import parse_config
from siphon_dagster.targets import build_target, clickhouse, snowflake
from siphon_dagster.targets.base import SourceColumn, TableSchema, Target, TargetError, change_batch_schema

TARGETS = ["clickhouse", "clickhouse_buffer", "snowflake", "snowflake_values", "snowflake_stage"]
# How each Snowflake variant loads a batch: `stage_min_rows` sends every batch one way (and
# `snowflake` has the VALUES path turned off, see `make_target`).
SNOWFLAKE_LOADS = {"snowflake": ("insert", 10**9), "snowflake_values": ("values", 10**9), "snowflake_stage": ("stage", 0)}
# Statements of a ClickHouse change batch: the resync table's lookup and one insert of the typed
# batch, its statement in front of the rows (`clickhouse`) or, as a large batch's is, in the URL
# (`clickhouse_buffer`: every batch goes that way).
CLICKHOUSE_BATCH_STATEMENTS = {"clickhouse": 2, "clickhouse_buffer": 2}


def target_settings(request: pytest.FixtureRequest, name: str, unique_name: str) -> dict:
    """siphon.yaml's `targets.<name>` for a database (ClickHouse) or schema (Snowflake) of this test alone."""
    if name.startswith("clickhouse"):
        return {"url": request.getfixturevalue("clickhouse_url"), "database": unique_name}
    env = request.getfixturevalue("snowflake_env")
    _path, stage_min_rows = SNOWFLAKE_LOADS.get(name, ("stage", 1000))
    return {
        "stage_min_rows": stage_min_rows,
        "account": env["SIPHON_SNOWFLAKE_ACCOUNT"],
        "user": env["SIPHON_SNOWFLAKE_USER"],
        "password": env["SIPHON_SNOWFLAKE_PASSWORD"],
        "host": env["SIPHON_SNOWFLAKE_HOST"],
        "port": int(env["SIPHON_SNOWFLAKE_PORT"]),
        "protocol": env["SIPHON_SNOWFLAKE_PROTOCOL"],
        "database": "SIPHON",
        "schema": unique_name,
    }


def make_target(request: pytest.FixtureRequest, name: str, unique_name: str, **settings: object) -> Target:
    """A target whose database (ClickHouse) or schema (Snowflake) belongs to this test alone;
    `settings` override its siphon.yaml keys."""
    if name == "snowflake":  # the staging table filled by INSERT, whatever the batch's size
        request.getfixturevalue("monkeypatch").setattr(snowflake, "VALUES_MAX_ROWS", 0)
    kind = "snowflake" if name.startswith("snowflake") else "clickhouse"
    config = parse_config(
        {"application_identifier": "test", "source": {"dsn": "postgresql://x@127.0.0.1/x"}, "tables": [{"name": "public.t"}],
         "targets": {kind: {**target_settings(request, name, unique_name), **settings}}}
    )
    return build_target(kind, config)


def assert_load_path(target: Target, variant: str, snapshot: bool = False) -> None:
    """A Snowflake variant loaded its last batch the way it is set to (a snapshot range never goes
    as VALUES: the staging table's INSERT instead)."""
    if variant in SNOWFLAKE_LOADS:
        path = SNOWFLAKE_LOADS[variant][0]
        assert target.last_load_path == ("insert" if snapshot and path == "values" else path)  # type: ignore[attr-defined]


@pytest.fixture(params=TARGETS)
def target(request: pytest.FixtureRequest, unique_name: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Target]:
    if request.param == "clickhouse_buffer":
        monkeypatch.setattr(clickhouse, "INLINE_STATEMENT_MAX_BYTES", -1)
    built = make_target(request, request.param, unique_name)
    yield built
    built.close()


@pytest.fixture
def variant(request: pytest.FixtureRequest) -> str:
    """The `target` parameter of this test: one of TARGETS."""
    return request.node.callspec.params["target"]


NOTES = TableSchema(
    "public",
    "notes",
    (
        SourceColumn("id", 20, "bigint", nullable=False, primary_key=True),
        SourceColumn("body", 25, "text"),
        SourceColumn("score", 23, "integer", nullable=False),
    ),
)


def batch(table: TableSchema, rows: list[tuple]) -> pa.Table:
    """Rows as (value, ..., version, deleted) with values as PostgreSQL text."""
    schema = change_batch_schema(table)
    columns = list(zip(*rows, strict=True)) if rows else [[] for _ in schema]
    return pa.table([pa.array(list(values), type=f.type) for values, f in zip(columns, schema, strict=True)], schema=schema)


@dataclass
class Rows:
    rows: list[tuple]


@dataclass
class Snapshot:
    copy_text: bytes
    version: int


@dataclass
class Truncate:
    version: int


@dataclass
class Scenario:
    name: str
    steps: list
    current: list[tuple]
    max_version: int
    notes: list[str] = field(default_factory=list)


def row(key: int, body: str | None, score: int, version: int, deleted: bool = False) -> tuple:
    return (str(key), body, str(score), version, deleted)


def tombstone(key: int, version: int) -> tuple:
    # A delete carries the old key only; NOT NULL columns arrive empty too.
    return (str(key), None, None, version, True)


SCENARIOS = [
    Scenario("in order", [Rows([row(1, "a", 1, 10)]), Rows([row(1, "b", 2, 20)])], [("1", "b", "2")], 20),
    Scenario("older version applied later loses", [Rows([row(1, "new", 2, 20)]), Rows([row(1, "old", 1, 10)])], [("1", "new", "2")], 20),
    Scenario(
        "duplicate apply is idempotent",
        [Rows([row(1, "a", 1, 10), row(2, "b", 2, 11)]), Rows([row(1, "a", 1, 10), row(2, "b", 2, 11)])],
        [("1", "a", "1"), ("2", "b", "2")],
        11,
    ),
    Scenario("versions out of order in one batch", [Rows([row(1, "v3", 3, 30), row(1, "v1", 1, 10), row(1, "v2", 2, 20)])], [("1", "v3", "3")], 30),
    Scenario("latest version is a tombstone", [Rows([row(1, "a", 1, 10), tombstone(1, 20), row(2, "b", 2, 15)])], [("2", "b", "2")], 20),
    Scenario("older insert after a delete stays deleted", [Rows([row(1, "a", 1, 10)]), Rows([tombstone(1, 30)]), Rows([row(1, "late", 9, 20)])], [], 30),
    Scenario("newer insert after a delete revives the key", [Rows([row(1, "a", 1, 10)]), Rows([tombstone(1, 20)]), Rows([row(1, "c", 3, 30)])], [("1", "c", "3")], 30),
    Scenario(
        "snapshot older than the stream loses, newer wins",
        [Rows([row(1, "stream", 5, 30)]), Snapshot(b"1\tsnap-old\t1\n2\tsnap-old\t2\n", 25), Snapshot(b"2\tsnap-new\t7\n", 35)],
        [("1", "stream", "5"), ("2", "snap-new", "7")],
        35,
    ),
    Scenario(
        "truncate tombstones every older row, later changes still apply",
        [
            Rows([row(1, "a", 1, 10), row(2, "b", 2, 11)]),
            Rows([tombstone(2, 12)]),
            Truncate(50),
            Rows([row(1, "replayed", 1, 40), row(2, "replayed", 2, 45)]),
            Rows([row(3, "after", 3, 60)]),
        ],
        [("3", "after", "3")],
        60,
    ),
    Scenario(
        "snapshot read before a truncate and applied after it stays invisible",
        [Rows([row(1, "a", 1, 10)]), Truncate(50), Snapshot(b"1\tsnap\t1\n2\tunseen\t2\n", 45), Snapshot(b"3\tnew\t3\n", 55)],
        [("3", "new", "3")],
        55,
    ),
    Scenario(
        "versions beyond 64 bits order correctly",
        [Rows([row(1, "high", 1, (0xFFFFFFFF_FFFFFFFF << 32) | 7)]), Rows([row(1, "low", 2, (0xFFFFFFFF_FFFFFFFF << 32) | 6)]),
         Snapshot(b"1\tsnap\t3\n2\tsnap\t4\n", (0xFFFFFFFF_FFFFFFFF << 32) | 5)],
        [("1", "high", "1"), ("2", "snap", "4")],
        (0xFFFFFFFF_FFFFFFFF << 32) | 7,
    ),
]


def run_steps(target: Target, table: TableSchema, steps: list, variant: str = "") -> None:
    for step in steps:
        if isinstance(step, Rows):
            target.apply_rows(table, batch(table, step.rows))
            assert_load_path(target, variant)
            if variant in CLICKHOUSE_BATCH_STATEMENTS:
                assert target.last_load_statements == CLICKHOUSE_BATCH_STATEMENTS[variant]  # type: ignore[attr-defined]
        elif isinstance(step, Snapshot):
            target.apply_copy_text(table, iter([step.copy_text]), step.version)
            assert_load_path(target, variant, snapshot=True)
        else:
            current_before = target.count_current(table)
            assert target.tombstone_all(table, step.version) == current_before


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_version_rule(target: Target, variant: str, scenario: Scenario) -> None:
    assert target.ensure_table(NOTES).created
    run_steps(target, NOTES, scenario.steps, variant)
    assert target.current_rows_as_text(NOTES) == scenario.current
    assert target.count_current(NOTES) == len(scenario.current)
    assert target.max_version(NOTES) == scenario.max_version


AWKWARD = TableSchema(
    'Sch "é" x',
    'select "T" Table',
    (
        SourceColumn("Key One", 25, "text", nullable=False, primary_key=True),
        SourceColumn("order", 23, "integer", nullable=False, primary_key=True),
        SourceColumn('Val"ue`s\\', 25, "text"),
        SourceColumn("Größe", 701, "double precision"),
        SourceColumn("{x:String}%s", 16, "boolean"),
    ),
)


def test_composite_key_and_awkward_identifiers(target: Target, variant: str) -> None:
    assert target.ensure_table(AWKWARD).created
    rows = [
        ("a b", "1", "first", "1.5", "t", 10, False),
        ("a b", "2", "second", "NaN", "f", 11, False),
        ("a b", "1", "older", "0", "f", 5, False),  # same key as the first, older: ignored
        ("c'd", "1", "gone", None, None, 12, False),
    ]
    target.apply_rows(AWKWARD, batch(AWKWARD, rows))
    target.apply_rows(AWKWARD, batch(AWKWARD, [("c'd", "1", None, None, None, 13, True)]))
    target.apply_copy_text(AWKWARD, iter([b"a b\t2\tsnap\t-0\tt\n", b"e\\tf\t3\tx\\\\y\t1e+300\t\\N\n"]), 12)
    assert_load_path(target, variant, snapshot=True)
    assert target.current_rows_as_text(AWKWARD) == [
        ("a b", "1", "first", "1.5", "t"),
        ("a b", "2", "snap", "-0", "t"),
        ("e\tf", "3", "x\\y", "1e+300", None),
    ]
    found = target.read_current_values(AWKWARD, [("a b", "2"), ("c'd", "1"), ("e\tf", "3")], ['Val"ue`s\\', "Größe"])
    assert found == {("a b", "2"): {'Val"ue`s\\': "snap", "Größe": "-0"}, ("e\tf", "3"): {'Val"ue`s\\': "x\\y", "Größe": "1e+300"}}
    described = [c.name for c in target.describe_columns(AWKWARD)]
    assert described == [*AWKWARD.column_names, "_siphon_version", "_siphon_deleted", "_siphon_synced_at"]


def test_a_table_exists_once_ensured_and_a_second_ensure_changes_nothing(target: Target) -> None:
    assert not target.table_exists(NOTES)
    assert target.ensure_table(NOTES).created
    assert target.table_exists(NOTES)
    again = target.ensure_table(NOTES)
    assert (again.created, again.added_columns, again.incompatible) == (False, [], [])
    target.apply_rows(NOTES, batch(NOTES, [row(1, "a", 1, 10)]))  # the view and (ClickHouse) the landing were made
    assert target.current_rows_as_text(NOTES) == [("1", "a", "1")]


def test_new_source_column_is_added_and_type_change_reported(target: Target) -> None:
    target.ensure_table(NOTES)
    target.apply_rows(NOTES, batch(NOTES, [row(1, "a", 1, 10)]))
    grown = TableSchema("public", "notes", (*NOTES.columns, SourceColumn("tags", 1009, "text[]")))
    change = target.ensure_table(grown)
    assert (change.created, change.added_columns, change.incompatible) == (False, ["tags"], [])
    target.apply_rows(grown, batch(grown, [("2", "b", "2", "{x,NULL}", 11, False)]))
    assert target.current_rows_as_text(grown) == [("1", "a", "1", None), ("2", "b", "2", "{x,NULL}")]
    retyped = TableSchema("public", "notes", (*NOTES.columns[:2], SourceColumn("score", 16, "boolean", nullable=False), grown.columns[3]))
    change = target.ensure_table(retyped)
    assert change.added_columns == [] and [c.split(":")[0] for c in change.incompatible] == ["score"]


def test_a_widened_integer_column_is_widened_in_place(target: Target) -> None:
    # ALTER TABLE ... ALTER COLUMN score TYPE bigint at the source: every stored value fits.
    target.ensure_table(NOTES)
    target.apply_rows(NOTES, batch(NOTES, [row(1, "a", 2147483647, 10)]))
    widened = TableSchema("public", "notes", (*NOTES.columns[:2], SourceColumn("score", 20, "bigint", nullable=False)))
    change = target.ensure_table(widened)
    assert (change.added_columns, change.incompatible) == ([], [])
    target.apply_rows(widened, batch(widened, [row(2, "b", 9007199254740993, 11)]))
    assert target.current_rows_as_text(widened) == [("1", "a", "2147483647"), ("2", "b", "9007199254740993")]
    assert target.ensure_table(widened).incompatible == []
    narrowed = TableSchema("public", "notes", (*NOTES.columns[:2], SourceColumn("score", 21, "smallint", nullable=False)))
    assert [c.split(":")[0] for c in target.ensure_table(narrowed).incompatible] == ["score"]


def test_resync_through_shadow_keeps_the_view_readable(target: Target, variant: str) -> None:
    target.ensure_table(NOTES)
    target.apply_rows(NOTES, batch(NOTES, [row(1, "drifted", 1, 10), row(2, "kept", 2, 10)]))
    target.create_shadow(NOTES)
    # The resync's snapshot goes to the shadow only; the stream meanwhile writes to both.
    target.apply_copy_text(NOTES, iter([b"2\tkept\t2\n3\tnew\t3\n"]), 20, shadow=True)
    assert_load_path(target, variant, snapshot=True)
    target.apply_rows(NOTES, batch(NOTES, [row(3, "streamed", 4, 30)]))
    assert_load_path(target, variant)
    assert target.current_rows_as_text(NOTES) == [("1", "drifted", "1"), ("2", "kept", "2"), ("3", "streamed", "4")]
    target.swap_shadow(NOTES)
    assert target.current_rows_as_text(NOTES) == [("2", "kept", "2"), ("3", "streamed", "4")]
    target.apply_rows(NOTES, batch(NOTES, [tombstone(2, 40)]))
    assert target.current_rows_as_text(NOTES) == [("3", "streamed", "4")]
    target.drop_table(NOTES)
    assert target.describe_columns(NOTES) == []


def test_a_runs_tables_learn_of_resync_tables_from_one_listing(target: Target) -> None:
    """Siblings (a streaming run's tables) trust one listing of the namespace's resync tables for
    `shadow_lookup_seconds`: a batch of another table within it sends no look-up of its own, and
    a resync table made since is found by the first batch after it."""
    other = TableSchema("public", "other notes", NOTES.columns)
    # Long enough that a batch's own statements, slow on a loaded machine, never outlast it.
    trust = 3.0
    target.shadow_lookup_seconds = trust  # type: ignore[attr-defined]
    sibling = target.sibling()  # type: ignore[attr-defined]
    target.ensure_table(NOTES)
    sibling.ensure_table(other)
    # A first load of each (a Snowflake session then creates its stage), then the listing expires.
    target.apply_rows(NOTES, batch(NOTES, [row(1, "first", 1, 5)]))
    sibling.apply_rows(other, batch(other, [row(1, "other", 1, 5)]))
    time.sleep(trust + 0.1)
    target.apply_rows(NOTES, batch(NOTES, [row(1, "first", 1, 10)]))
    listed = target.last_load_statements  # type: ignore[attr-defined]
    sibling.apply_rows(other, batch(other, [row(1, "other", 1, 10)]))
    assert sibling.last_load_statements == listed - 1  # type: ignore[attr-defined]
    target.create_shadow(NOTES)
    time.sleep(trust + 0.1)
    sibling.apply_rows(other, batch(other, [row(2, "other", 2, 20)]))  # lists again: one shadow, not its own
    assert sibling.last_load_statements == listed  # type: ignore[attr-defined]
    target.apply_rows(NOTES, batch(NOTES, [row(2, "streamed", 2, 20)]))  # the listing's answer: both tables
    target.swap_shadow(NOTES)
    assert target.current_rows_as_text(NOTES) == [("2", "streamed", "2")]
    assert sibling.current_rows_as_text(other) == [("1", "other", "1"), ("2", "other", "2")]
    sibling.close()


def test_a_snapshot_during_a_resync_reaches_the_resync_table_and_the_live_one(target: Target) -> None:
    # A column the live table got later stays Nullable there, while the resync table, made from the
    # source's columns, has it NOT NULL: each table gets the snapshot's rows in its own structure.
    target.ensure_table(NOTES)
    target.apply_rows(NOTES, batch(NOTES, [row(1, "before", 1, 10)]))
    grown = TableSchema("public", "notes", (*NOTES.columns, SourceColumn("ratio", 701, "double precision", nullable=False)))
    assert target.ensure_table(grown).added_columns == ["ratio"]
    target.create_shadow(grown)
    target.apply_copy_text(grown, iter([b"1\tsnap\t1\t0.5\n2\tsnap\t2\t-Infinity\n"]), 20)
    expected = [("1", "snap", "1", "0.5"), ("2", "snap", "2", "-Infinity")]
    assert target.current_rows_as_text(grown) == expected
    target.swap_shadow(grown)
    assert target.current_rows_as_text(grown) == expected


def test_the_rows_around_a_version_count_tombstones_and_truncates_alike_at_every_target(target: Target) -> None:
    target.ensure_table(NOTES)
    target.apply_rows(NOTES, batch(NOTES, [row(k, "a", k, 10) for k in range(1, 7)]))
    target.apply_rows(NOTES, batch(NOTES, [row(2, "b", 2, 30), tombstone(3, 30), row(7, "new", 7, 30)]))
    changes = target.changes_around(NOTES, 20, 10)
    # 1, 4, 5, 6 unchanged; 2 and 7 current after the version; 3 deleted after it.
    assert (changes.counts.at_or_below, changes.counts.above, changes.counts.tombstones_above) == (4, 2, 1)
    assert sorted(changes.changed_keys or []) == [("2",), ("3",), ("7",)]
    assert target.changes_around(NOTES, 20, 2).changed_keys is None
    target.tombstone_all(NOTES, 40)  # a TRUNCATE after the version: every key changed
    changes = target.changes_around(NOTES, 20, 10)
    assert (changes.counts.at_or_below, changes.counts.above) == (0, 0)
    assert sorted(changes.changed_keys or []) == [(str(k),) for k in range(1, 8)]


def test_clickhouse_reads_the_rows_around_a_version_in_one_scan_when_the_stream_moved_them(
        request: pytest.FixtureRequest, unique_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The view's count is read before and after the changed keys; when the stream moved it in
    between, the one-scan read (one set of the table's parts) gives the answer instead."""
    target = make_target(request, "clickhouse", unique_name)
    target.ensure_table(NOTES)
    target.apply_rows(NOTES, batch(NOTES, [row(k, "a", k, 10) for k in range(1, 5)]))
    quick = target.changes_around(NOTES, 20, 10)
    counted = target._quick_counts  # noqa: SLF001
    reads = []

    def moved_between(names, version):  # type: ignore[no-untyped-def]
        reads.append(version)
        if len(reads) == 2:  # the stream applies a batch between the view's two reads
            target.apply_rows(NOTES, batch(NOTES, [row(1, "moved", 1, 30)]))
        return counted(names, version)

    monkeypatch.setattr(target, "_quick_counts", moved_between)
    changes = target.changes_around(NOTES, 20, 10)
    assert len(reads) == 2
    assert (quick.counts.at_or_below, quick.changed_keys) == (4, [])
    assert (changes.counts.at_or_below, changes.counts.above, changes.changed_keys) == (3, 1, [("1",)])
    target.close()


def resync_ready_to_swap(request: pytest.FixtureRequest, variant: str, unique_name: str) -> tuple[Target, Target]:
    """A Snowflake target (fakesnow: it swaps by three renames) whose live table holds a row that
    drifted and whose resync table holds the snapshot's, and a sibling connection that writes as
    the stream does."""
    target = make_target(request, variant, unique_name)
    writer = target.sibling()  # type: ignore[attr-defined]
    target.ensure_table(NOTES)
    target.apply_rows(NOTES, batch(NOTES, [row(1, "drifted", 1, 10)]))
    target.create_shadow(NOTES)
    target.apply_copy_text(NOTES, iter([b"2\tkept\t2\n"]), 20, shadow=True)
    return target, writer


def after_each_rename(monkeypatch: pytest.MonkeyPatch, target: Target, hook) -> list[str]:  # type: ignore[no-untyped-def]
    """Calls `hook(renames done)` after each rename of a swap by renames; returns the renames as done."""
    execute = target._execute  # type: ignore[attr-defined]  # noqa: SLF001
    renames: list[str] = []

    def then_hook(names, what, statement, *args, **kwargs):  # type: ignore[no-untyped-def]
        result = execute(names, what, statement, *args, **kwargs)
        if what == "swapping in the resync table by renames":
            renames.append(statement)
            hook(len(renames))
        return result

    monkeypatch.setattr(target, "_execute", then_hook)
    return renames


class StreamWrite:
    """One stream write of `rows` on a thread of its own (not started); what it raised is kept."""

    def __init__(self, writer: Target, rows: list) -> None:
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._write, args=(writer, rows))

    def _write(self, writer: Target, rows: list) -> None:
        try:
            writer.apply_rows(NOTES, batch(NOTES, rows))
        except BaseException as error:  # noqa: BLE001 - reported by the test's assertion
            self.errors.append(error)


@pytest.mark.parametrize("variant", list(SNOWFLAKE_LOADS))
def test_a_stream_write_between_the_renames_of_a_swap_reaches_the_rebuilt_table(
        request: pytest.FixtureRequest, unique_name: str, variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """fakesnow has no SWAP WITH, so a resync swaps by three renames; a stream write (another
    connection) whose live write falls after the first rename finds no live table, waits for the
    swap to end and writes again, into the rebuilt table."""
    target, writer = resync_ready_to_swap(request, variant, unique_name)

    live_write_failed = threading.Event()
    waits_for_live = writer._live_table_back  # noqa: SLF001

    def noted_wait(names):  # type: ignore[no-untyped-def]
        live_write_failed.set()
        return waits_for_live(names)

    monkeypatch.setattr(writer, "_live_table_back", noted_wait)
    stream_write = StreamWrite(writer, [row(3, "streamed", 3, 30)])
    stream, errors = stream_write.thread, stream_write.errors
    def paused_after_first_rename(done: int) -> None:
        if done == 1:
            # The live name is empty now: the stream write runs, and fails on it, before the swap goes on.
            stream.start()
            while not live_write_failed.wait(0.1):
                assert stream.is_alive(), f"the stream write ended before the swap did: {errors}"

    renames = after_each_rename(monkeypatch, target, paused_after_first_rename)
    target.swap_shadow(NOTES)
    stream.join(60)
    assert len(renames) == 3 and not stream.is_alive()
    assert errors == []
    assert target.current_rows_as_text(NOTES) == [("2", "kept", "2"), ("3", "streamed", "3")]
    target.close()
    writer.close()


@pytest.mark.parametrize("variant", list(SNOWFLAKE_LOADS))
def test_a_stream_write_to_the_resync_table_between_the_last_renames_of_a_swap_goes_on(
        request: pytest.FixtureRequest, unique_name: str, variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream write that trusts its look-up of the resync table reaches it after the swap's second
    rename (the name is empty) and looks again after the third (the previous live table holds the
    name until it is dropped): the write goes on to the rebuilt table, and the stream does not stop."""
    target, writer = resync_ready_to_swap(request, variant, unique_name)
    writer.shadow_lookup_seconds = 600  # the look-up made while the resync table existed is trusted
    writer.apply_rows(NOTES, batch(NOTES, [row(3, "streamed", 3, 30)]))  # to the resync table and the live one

    write_failed, third_rename_done = threading.Event(), threading.Event()
    looks = writer._shadow_exists  # noqa: SLF001

    def look_after_the_third_rename(names):  # type: ignore[no-untyped-def]
        write_failed.set()
        assert third_rename_done.wait(60), "the swap did not go on"
        return looks(names)

    stream_write = StreamWrite(writer, [row(4, "during the swap", 4, 40)])
    stream, errors = stream_write.thread, stream_write.errors
    def paused_between_renames(done: int) -> None:
        if done == 2:  # the resync name is empty: the stream write fails on it
            monkeypatch.setattr(writer, "_shadow_exists", look_after_the_third_rename)
            stream.start()
            while not write_failed.wait(0.1):
                assert stream.is_alive(), f"the stream write ended before the swap went on: {errors}"
        elif done == 3:  # the previous live table holds the name until it is dropped
            third_rename_done.set()
            stream.join(60)

    renames = after_each_rename(monkeypatch, target, paused_between_renames)
    target.swap_shadow(NOTES)
    stream.join(60)
    assert len(renames) == 3 and not stream.is_alive()
    assert errors == []
    assert target.current_rows_as_text(NOTES) == [("2", "kept", "2"), ("3", "streamed", "3"),
                                                  ("4", "during the swap", "4")]
    target.close()
    writer.close()


def test_clickhouse_view_is_right_before_and_after_merges(request: pytest.FixtureRequest, unique_name: str) -> None:
    """Unmerged parts holding several versions of a key, the newest a tombstone, read right through
    the view; a forced merge keeps the tombstone, so an older change applied later stays invisible."""
    target = make_target(request, "clickhouse", unique_name)
    target.ensure_table(NOTES)
    client = target._connect()  # noqa: SLF001 - merges are ClickHouse-specific
    table = f"`{unique_name}`.`public__notes`"
    client.command(f"SYSTEM STOP MERGES {table}")
    for rows in ([row(1, "a", 1, 10), row(2, "b", 2, 10)], [tombstone(1, 30)], [row(1, "late", 1, 20)], [row(2, "b2", 3, 40)]):
        target.apply_rows(NOTES, batch(NOTES, rows))
    parts = client.command(f"SELECT count() FROM system.parts WHERE database = '{unique_name}' AND table = 'public__notes' AND active")
    assert int(parts) == 4
    assert target.current_rows_as_text(NOTES) == [("2", "b2", "3")]
    client.command(f"SYSTEM START MERGES {table}")
    client.command(f"OPTIMIZE TABLE {table} FINAL")
    target.apply_rows(NOTES, batch(NOTES, [row(1, "later", 1, 25)]))
    client.command(f"OPTIMIZE TABLE {table} FINAL")
    assert target.current_rows_as_text(NOTES) == [("2", "b2", "3")]
    assert target.max_version(NOTES) == 40
    target.close()


def test_clickhouse_writers_on_two_column_lists_and_landings_of_earlier_versions(request: pytest.FixtureRequest,
                                                                                  unique_name: str) -> None:
    """A batch's insert names its columns: a writer still on the old column list keeps writing when
    another has added one, and its rows read back with the new column NULL. A landing table and
    view that an earlier version inserted through go with the table."""
    old_writer = make_target(request, "clickhouse", unique_name)
    new_writer = make_target(request, "clickhouse", unique_name)
    client = old_writer._connect()  # noqa: SLF001 - the landings are ClickHouse-specific

    def landings() -> list[str]:
        return sorted(r[0] for r in client.query(
            "SELECT name FROM system.tables WHERE database = {d:String} AND name LIKE '%landing%'",
            parameters={"d": unique_name}).result_rows)

    old_writer.ensure_table(NOTES)
    old_writer.apply_rows(NOTES, batch(NOTES, [row(1, "a", 1, 10)]))
    assert landings() == []
    grown = TableSchema("public", "notes", (*NOTES.columns, SourceColumn("tags", 1009, "text[]")))
    new_writer.ensure_table(grown)
    new_writer.apply_rows(grown, batch(grown, [("2", "b", "2", "{x}", 11, False)]))
    old_writer.apply_rows(NOTES, batch(NOTES, [row(3, "c", 3, 12)]))
    assert old_writer.current_rows_as_text(grown) == [("1", "a", "1", None), ("2", "b", "2", "{x}"),
                                                       ("3", "c", "3", None)]
    legacy = f"`{unique_name}`.`public__notes__landing_0123456789ab`"
    client.command(f"CREATE TABLE {legacy} (c0 Nullable(String)) ENGINE = Null")
    client.command(f"CREATE MATERIALIZED VIEW `{unique_name}`.`public__notes__landing_0123456789ab_view` "
                   f"TO `{unique_name}`.`public__notes` AS SELECT toInt64(c0) AS id FROM {legacy}")
    assert len(landings()) == 2
    new_writer.drop_table(grown)
    assert landings() == []
    old_writer.close()
    new_writer.close()


def test_snowflake_view_reads_a_key_stored_twice_as_its_newest_copy(request: pytest.FixtureRequest,
                                                                      unique_name: str) -> None:
    """Two MERGEs inserting the same new key at once (a stream batch and a snapshot partition) can
    both insert it where writes are not serialized, as on fakesnow: the view reads the newest copy,
    a newest copy that is a tombstone hides the key, and a later MERGE updates every copy."""
    target = make_target(request, "snowflake", unique_name)
    target.ensure_table(NOTES)
    target.apply_rows(NOTES, batch(NOTES, [row(1, "first", 1, 10), row(2, "kept", 2, 10)]))
    names = target._names(NOTES)  # noqa: SLF001 - copies made the way a race makes them
    copy = (f"INSERT INTO {names.live} SELECT id, body, score, CAST(? AS NUMBER(38, 0)), ?, _siphon_synced_at "
            f"FROM {names.live} WHERE id = ?")
    target._execute(names, "copying a row", copy, ("20", False, 1))  # noqa: SLF001
    target._execute(names, "copying a row", copy, ("30", True, 2))  # noqa: SLF001
    assert target.count_current(NOTES) == 1
    assert target.current_rows_as_text(NOTES) == [("1", "first", "1")]
    target.apply_rows(NOTES, batch(NOTES, [row(1, "newest", 5, 40)]))
    assert target.current_rows_as_text(NOTES) == [("1", "newest", "5")]
    stored = target._fetch(names, "reading copies", f"SELECT body FROM {names.live} WHERE id = 1")  # noqa: SLF001
    assert [r[0] for r in stored] == ["newest", "newest"]
    target.close()


def test_a_runs_clickhouse_tables_are_made_without_a_lookup_and_one_made_since_the_start_is_followed(
        request: pytest.FixtureRequest, unique_name: str) -> None:
    """A run's tables (siblings) new to the database are made straight away: one statement fewer
    each than asking first. A table another process made after the run read the database's tables
    is refused by that CREATE and then followed as any existing one (its new column added). A run
    started again reads its existing tables' columns without asking first either, and makes one
    dropped since its listing again."""
    run = make_target(request, "clickhouse", unique_name)
    snapshot = make_target(request, "clickhouse", unique_name)
    first, second, third = run.sibling(), run.sibling(), run.sibling()  # type: ignore[attr-defined]
    other = TableSchema("public", "others", NOTES.columns)
    late = TableSchema("public", "late", NOTES.columns)
    grown = TableSchema("public", "late", (*NOTES.columns, SourceColumn("tags", 1009, "text[]")))
    alone = make_target(request, "clickhouse", unique_name)  # a target of its own asks first, as before
    before = alone._statements  # type: ignore[attr-defined]  # noqa: SLF001
    assert alone.ensure_table(TableSchema("public", "own", NOTES.columns)).created
    asked_first = alone._statements - before  # type: ignore[attr-defined]  # noqa: SLF001

    before = first._statements  # noqa: SLF001
    assert first.ensure_table(NOTES).created  # reads the listing: the one statement it shares with the others
    before = second._statements  # noqa: SLF001
    assert second.ensure_table(other).created
    assert second._statements - before == asked_first - 1  # noqa: SLF001
    snapshot.ensure_table(late)  # made by another process after the run's listing
    change = third.ensure_table(grown)
    assert (change.created, change.added_columns, change.incompatible) == (False, ["tags"], [])
    again = first.ensure_table(NOTES)  # made by the run: read as an existing table, not made again
    assert (again.created, again.added_columns) == (False, [])
    third.apply_rows(grown, batch(grown, [("1", "a", "1", "{x}", 10, False)]))
    second.apply_rows(other, batch(other, [row(2, "b", 2, 10)]))
    assert third.current_rows_as_text(grown) == [("1", "a", "1", "{x}")]
    assert second.current_rows_as_text(other) == [("2", "b", "2")]
    with pytest.raises(TargetError, match="creating the table"):  # any other refusal still fails the batch
        first.ensure_table(TableSchema("public", "bad", (SourceColumn("id", 20, "bigint", primary_key=True),
                                                         SourceColumn("id", 25, "text"))))
    # A run started again (after a kill): its tables are there, and are read without the question.
    first_kept, second_kept = (TableSchema("public", name, NOTES.columns) for name in ("kept_1", "kept_2"))
    for kept in (first_kept, second_kept):
        snapshot.ensure_table(kept)
    again_run = make_target(request, "clickhouse", unique_name)
    restarted, fresh = again_run.sibling(), make_target(request, "clickhouse", unique_name)  # type: ignore[attr-defined]
    restarted.ensure_table(NOTES)  # reads the listing
    noted = (*NOTES.columns, SourceColumn("note", 25, "text"))
    before = fresh._statements  # type: ignore[attr-defined]  # noqa: SLF001
    assert fresh.ensure_table(TableSchema("public", "kept_1", noted)).added_columns == ["note"]
    asked_first = fresh._statements - before  # type: ignore[attr-defined]  # noqa: SLF001
    before = restarted._statements  # noqa: SLF001
    followed = restarted.ensure_table(TableSchema("public", "kept_2", noted))
    assert (followed.created, followed.added_columns) == (False, ["note"])
    assert restarted._statements - before == asked_first - 1  # noqa: SLF001
    snapshot.drop_table(late)  # dropped after the listing: looked for, and made again
    assert restarted.ensure_table(late).created
    for target in (run, snapshot, alone, again_run, fresh):
        target.close()
