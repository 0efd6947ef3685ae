"""Snowflake loads through a stage (Parquet, PUT, COPY INTO) on the fakesnow server: the same stored
rows as the INSERT path for every type, INSERT for tiny batches, and INSERT for good when the role
may not create a stage.

The version rule, the shadow writes of a resync and the every-type round trip also run on the stage
path: `test_targets_version_rule.py` and `test_type_round_trip.py` (the `snowflake_stage` variant).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator

import pyarrow as pa
import pytest
from snowflake.connector.errors import ProgrammingError

from siphon_core.config import SnowflakeTargetConfig
from siphon_dagster.targets import snowflake_stage
from siphon_dagster.targets.base import SourceColumn, TableSchema, TargetError, change_batch_schema
from siphon_dagster.targets.snowflake import SnowflakeTarget
from tests.integration.test_targets_version_rule import NOTES, batch, make_target, row, tombstone
from tests.integration.test_type_round_trip import Source


def stored_rows(target: SnowflakeTarget, table: TableSchema) -> list[tuple]:
    """The live table's rows as Snowflake stores them (typed values), without the sync time."""
    names = target._names(table)  # noqa: SLF001 - the stored values themselves, not the view
    columns = ", ".join(f'"{name}"' for name in [*table.column_names, "_siphon_version", "_siphon_deleted"])
    order = ", ".join(f'"{c.name}"' for c in table.key_columns)
    return [tuple(r) for r in target._fetch(names, "reading stored rows",  # noqa: SLF001
                                            f"SELECT {columns} FROM {names.live} ORDER BY {order}")]


def renamed(table: TableSchema, name: str) -> TableSchema:
    return TableSchema(table.schema, name, table.columns)


@pytest.fixture
def all_types(postgres_dsn: str) -> Iterator[Source]:
    source = Source(postgres_dsn, f"stage_types_{uuid.uuid4().hex[:8]}")
    source.create()
    yield source
    source.connection.execute(f'DROP SCHEMA "{source.schema}" CASCADE')
    source.connection.close()


def test_stage_and_insert_paths_store_the_same_rows(request: pytest.FixtureRequest, unique_name: str,
                                                    all_types: Source) -> None:
    """Every type the mapping covers, as a change batch (with a tombstone) and as COPY text: the
    stage path stores exactly the typed values the INSERT path stores."""
    by_insert = make_target(request, "snowflake", unique_name, stage_min_rows=10**9)
    by_stage = make_target(request, "snowflake", unique_name, stage_min_rows=0)
    text_rows = all_types.text_rows()
    schema = change_batch_schema(all_types.schema_for("x"))
    arrays = [pa.array(list(values), pa.string()) for values in zip(*text_rows, strict=True)]
    arrays.append(pa.array([10 + i for i in range(len(text_rows))], schema.field(len(arrays)).type))
    arrays.append(pa.array([i == 3 for i in range(len(text_rows))]))  # row 3 arrives as a tombstone
    changes = pa.Table.from_arrays(arrays, schema=schema)
    for target, suffix in ((by_insert, "insert"), (by_stage, "stage")):
        for kind in ("rows", "copy"):
            table = all_types.schema_for(f"{kind}_{suffix}")
            target.ensure_table(table)
            if kind == "rows":
                assert target.apply_rows(table, changes) == len(text_rows)
            else:
                assert target.apply_copy_text(table, iter(all_types.copy_chunks()), version=7) == len(text_rows)
            assert target.last_load_path == suffix
    for kind in ("rows", "copy"):
        table = all_types.schema_for(kind)
        inserted = stored_rows(by_insert, renamed(table, f"{kind}_insert"))
        staged = stored_rows(by_stage, renamed(table, f"{kind}_stage"))
        assert len(inserted) == len(text_rows)
        assert staged == inserted
    by_insert.close()
    by_stage.close()


def numbered_rows(count: int, first: int = 0, version: int = 10) -> pa.Table:
    return batch(NOTES, [row(first + i, f"note {first + i}", i, version + i) for i in range(count)])


def copy_text(count: int, first: int = 0) -> bytes:
    return b"".join(f"{first + i}\tsnap {first + i}\t{i}\n".encode() for i in range(count))


def test_small_batches_go_as_values_and_the_others_through_a_stage(
        request: pytest.FixtureRequest, unique_name: str) -> None:
    """At the default `stage_min_rows` (100): up to 99 rows go as the VALUES of the MERGE (the
    resync-table lookup and the MERGE), 100 and more through the stage, which runs the same
    statements whatever its size. A snapshot range below the threshold is inserted into a staging
    table (never VALUES: a range has no bound on its size until it is read)."""
    default = SnowflakeTargetConfig.model_fields["stage_min_rows"].default
    assert default == 100
    target = make_target(request, "snowflake_values", unique_name, stage_min_rows=default)
    target.ensure_table(NOTES)
    target.apply_rows(NOTES, numbered_rows(99, first=50_000))
    assert (target.last_load_path, target.last_load_statements) == ("values", 2)
    target.apply_rows(NOTES, numbered_rows(100, first=50_100))
    assert target.last_load_path == "stage"
    # The session's stage is created once: the next loads run one statement fewer.
    target.apply_rows(NOTES, numbered_rows(999))
    steady = target.last_load_statements
    target.apply_rows(NOTES, numbered_rows(20_000, first=2999))
    # CREATE TEMPORARY TABLE, PUT, COPY, the resync-table lookup, MERGE, DROP TABLE.
    assert (target.last_load_path, target.last_load_statements, steady) == ("stage", 6, 6)
    assert target.apply_copy_text(NOTES, iter([copy_text(99, first=30_000)]), 1) == 99
    assert target.last_load_path == "insert"
    assert target.apply_copy_text(NOTES, iter([copy_text(100, first=40_000)]), 1) == 100
    assert target.last_load_path == "stage"
    assert target.count_current(NOTES) == 99 + 100 + 999 + 20_000 + 99 + 100
    target.close()


def test_a_large_range_travels_as_several_files_in_one_copy(request: pytest.FixtureRequest, unique_name: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot range larger than one file is cut into files (each PUT once written), loaded by
    one COPY; rows and versions arrive intact, and the stage is left empty."""
    monkeypatch.setattr(snowflake_stage, "ROWS_PER_GROUP", 1000)
    monkeypatch.setattr(snowflake_stage, "FILE_BYTES", 1)  # a file per row group
    target = make_target(request, "snowflake", unique_name, stage_min_rows=0)
    target.ensure_table(NOTES)
    target.apply_rows(NOTES, batch(NOTES, [row(5, "stream, newer", 1, 10**20)]))
    chunks = [copy_text(4500)[i : i + 4096] for i in range(0, len(copy_text(4500)), 4096)]
    assert target.apply_copy_text(NOTES, iter(chunks), 10**19) == 4500
    # CREATE TEMPORARY TABLE, 5 PUTs, COPY, the resync-table lookup, MERGE, DROP TABLE.
    assert (target.last_load_path, target.last_load_statements) == ("stage", 10)
    rows = target.current_rows_as_text(NOTES)
    assert len(rows) == 4500 and rows[0] == ("0", "snap 0", "0") and rows[-1] == ("4499", "snap 4499", "4499")
    assert rows[5] == ("5", "stream, newer", "1")
    names = target._names(NOTES)  # noqa: SLF001
    assert target._fetch(names, "listing the stage", f'LIST @"{target._session()["load_stage"]}"') == []  # noqa: SLF001
    target.close()


def test_a_bad_copy_row_is_refused_by_name_on_the_stage_path(request: pytest.FixtureRequest, unique_name: str) -> None:
    target = make_target(request, "snowflake", unique_name, stage_min_rows=0)
    target.ensure_table(NOTES)
    with pytest.raises(TargetError, match=r"public\.notes.*COPY row 2 has 2 fields, the table has 3 columns"):
        target.apply_copy_text(NOTES, iter([b"1\ta\t1\n2\tb\n"]), 5)
    assert target.count_current(NOTES) == 0
    target.close()


class _WarningsOf(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class StagelessRoleTarget(SnowflakeTarget):
    """A target whose role lacks CREATE STAGE on its schema.

    fakesnow has no roles or privileges, so the refusal is simulated at the one seam where the stage
    is created: it raises the error Snowflake raises there (003001, SQLSTATE 42501, "SQL access
    control error: Insufficient privileges to operate on schema ..."), as the connector would.
    Everything else (the INSERT fallback, the MERGE, the reads) runs on the fakesnow server.
    """

    attempts = 0

    def _create_load_stage(self, name: str) -> None:
        StagelessRoleTarget.attempts += 1
        raise ProgrammingError(msg=f"SQL access control error:\nInsufficient privileges to operate on schema '{self.schema}'",
                               errno=3001, sqlstate="42501")


def test_a_role_without_stage_privilege_falls_back_to_insert_with_one_warning(
        request: pytest.FixtureRequest, unique_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snowflake_stage, "_refused", set())
    warnings = _WarningsOf()
    logger = logging.getLogger("siphon.targets.snowflake")
    logger.addHandler(warnings)
    try:
        config = make_target(request, "snowflake", unique_name, stage_min_rows=0).config
        first, second = StagelessRoleTarget(config), StagelessRoleTarget(config)
        first.ensure_table(NOTES)
        first.apply_rows(NOTES, numbered_rows(3000))
        assert first.last_load_path == "insert"
        first.apply_copy_text(NOTES, iter([copy_text(2000, first=5000)]), 1)
        # A second target of the same process and schema does not try again.
        second.apply_rows(NOTES, batch(NOTES, [row(1, "changed", 1, 100), tombstone(2, 100)]))
        assert (first.last_load_path, second.last_load_path) == ("insert", "insert")
        assert StagelessRoleTarget.attempts == 1
        assert len(warnings.messages) == 1
        assert f'lacks CREATE STAGE on schema \\"SIPHON\\".\\"{first.schema}\\"' in warnings.messages[0]
        assert first.count_current(NOTES) == 3000 + 2000 - 1
        assert first.read_current_values(NOTES, [("1",)], ["body"]) == {("1",): {"body": "changed"}}
        # Another schema, where the role may create a stage, still loads through one.
        other = make_target(request, "snowflake", f"{unique_name}_other", stage_min_rows=0)
        other.ensure_table(NOTES)
        other.apply_rows(NOTES, numbered_rows(10))
        assert other.last_load_path == "stage"
        for target in (first, second, other):
            target.close()
    finally:
        logger.removeHandler(warnings)


def test_a_refusal_that_is_not_about_privileges_is_an_error(request: pytest.FixtureRequest, unique_name: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the access control error means "use INSERT"; any other failure to create the stage stops
    the load with the table named."""
    monkeypatch.setattr(snowflake_stage, "_refused", set())
    config = make_target(request, "snowflake", unique_name, stage_min_rows=0).config

    class Broken(SnowflakeTarget):
        def _create_load_stage(self, name: str) -> None:
            raise ProgrammingError(msg="Object does not exist", errno=2003, sqlstate="02000")

    target = Broken(config)
    target.ensure_table(NOTES)
    with pytest.raises(TargetError, match=r"public\.notes.*creating a load stage failed"):
        target.apply_rows(NOTES, numbered_rows(5))
    target.close()


WIDE = TableSchema("public", "wide", tuple(
    [SourceColumn("id", 23, "integer", nullable=False, primary_key=True)]
    + [SourceColumn(f"c{i}", 25, "text") for i in range(40)]))


def test_a_wide_batch_on_the_stage_path(request: pytest.FixtureRequest, unique_name: str) -> None:
    """Forty text columns (staging names c0..c40 in the file, whatever the source names)."""
    target = make_target(request, "snowflake", unique_name, stage_min_rows=0)
    target.ensure_table(WIDE)
    rows = [(str(k), *[f"v{k}.{i}" if i % 3 else None for i in range(40)], 5, False) for k in range(50)]
    target.apply_rows(WIDE, batch(WIDE, rows))
    assert target.last_load_path == "stage"
    current = target.current_rows_as_text(WIDE)
    assert sorted(current, key=lambda r: int(r[0])) == [r[:-2] for r in rows]
    target.close()


def test_a_runs_tables_load_through_one_session_and_stage_per_thread(request: pytest.FixtureRequest,
                                                                     unique_name: str) -> None:
    """Siblings (a streaming run's tables) on one thread share its session and its temporary stage:
    only the first load creates the stage. Another thread has a session of its own, and a session
    that ended is replaced by a new one, with a new stage."""
    first = make_target(request, "snowflake", unique_name, stage_min_rows=0)
    tables = [renamed(NOTES, f"notes {k}") for k in range(3)]
    siblings = [first.sibling() for _ in tables]  # type: ignore[attr-defined]
    for sibling, table in zip(siblings, tables, strict=True):
        sibling.ensure_table(table)
    loads = []
    for version, (sibling, table) in enumerate(zip(siblings, tables, strict=True), start=1):
        sibling.apply_rows(table, numbered_rows(5, version=10 * version))
        loads.append((sibling.last_load_path, sibling.last_load_statements))
    # The first load's CREATE STAGE, then the stage path's six statements for every table.
    assert loads == [("stage", 7), ("stage", 6), ("stage", 6)]
    other_thread: list[tuple] = []
    worker = threading.Thread(target=lambda: other_thread.append((
        siblings[1].apply_rows(tables[1], numbered_rows(3, first=100)), siblings[1].last_load_statements)))
    worker.start()
    worker.join()
    assert other_thread == [(3, 7)]  # a session, and a stage, of its own
    shared = first._sibling_connections  # noqa: SLF001
    assert shared is not None and shared.opened == 2
    # The session ends under the run (its tokens gone, as when it expired beyond renewal): the
    # connector answers 250002, SQLSTATE 08003. The batch fails; its retry logs in again.
    siblings[2]._connect().rest.close()  # noqa: SLF001
    with pytest.raises(TargetError, match=r"public\.notes 0.*Connection is closed"):
        siblings[0].apply_rows(tables[0], numbered_rows(2, first=200))
    siblings[0].apply_rows(tables[0], numbered_rows(2, first=200))
    assert siblings[0].last_load_statements == 7 and shared.opened == 2  # a new session makes a new stage
    assert [siblings[k].count_current(tables[k]) for k in range(3)] == [5 + 2, 5 + 3, 5]
    first.close()
    assert shared.opened == 0
