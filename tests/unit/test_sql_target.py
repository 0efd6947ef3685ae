"""The SQL-target base without a server: the statements it builds over each dialect, how values are
bound, and the pieces of its lifecycle that are pure logic. What the statements do is tested on
real servers in tests/integration (test_targets_version_rule.py, test_resync.py, test_checks.py)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from siphon_core.config import ClickHouseTargetConfig, SnowflakeTargetConfig
from siphon_dagster.targets.base import (
    SourceColumn,
    TableSchema,
    Target,
    TargetError,
    TargetRow,
    VersionCounts,
)
from siphon_dagster.targets.clickhouse import ClickHouseTarget
from siphon_dagster.targets.clickhouse_sql import dialect as clickhouse
from siphon_dagster.targets.names import TableNames
from siphon_dagster.targets.snowflake import SnowflakeTarget
from siphon_dagster.targets.snowflake_sql import dialect as snowflake
from siphon_dagster.targets.sql_dialect import Bindings, SqlDialect, Statement, check_columns
from siphon_dagster.targets.sql_target import SqlTarget, chunks, target_rows
from siphon_dagster.targets.type_mapping import SNOWFLAKE_TEXT, TargetType, mapping_for

ORDERS = TableSchema("public", "Orders", (
    SourceColumn("region", 25, "text", nullable=False, primary_key=True),
    SourceColumn("id", 23, "integer", nullable=False, primary_key=True),
    SourceColumn("note", 25, "text"),
))


def names_of(dialect: SqlDialect, namespace: tuple[str, ...]) -> TableNames:
    return TableNames(table=ORDERS, target=dialect.name, namespace=namespace, quote=dialect.quote)


CH = names_of(clickhouse, ("siphon",))
SF = names_of(snowflake, ("SIPHON", "PUBLIC"))


def test_the_names_of_a_table_are_quoted_by_the_target_inside_its_namespace() -> None:
    assert (CH.live, CH.shadow, CH.truncations, CH.view) == (
        "`siphon`.`public__Orders`", "`siphon`.`public__Orders__resync`",
        "`siphon`.`public__Orders__truncations`", "`siphon`.`public__Orders_current`")
    assert SF.live == '"SIPHON"."PUBLIC"."public__Orders"'
    assert (SF.bare("shadow"), SF.bare("view"), SF.table_name) == (
        "public__Orders__resync", "public__Orders_current", "public__Orders")
    assert SF.describe("it failed") == "snowflake SIPHON.PUBLIC.public__Orders (public.Orders): it failed"


def test_a_table_without_a_key_or_with_siphons_column_names_is_refused_by_name() -> None:
    keyless = TableSchema("public", "log", (SourceColumn("line", 25, "text"),))
    with pytest.raises(TargetError, match=r"public\.log has no primary key"):
        check_columns(keyless)
    clash = TableSchema("public", "t", (SourceColumn("id", 23, "integer", nullable=False, primary_key=True),
                                        SourceColumn("_siphon_version", 20, "bigint")))
    with pytest.raises(TargetError, match=r"public\.t: column names \['_siphon_version'\] are reserved"):
        check_columns(clash)


def test_each_dialect_spells_the_shared_table_and_view() -> None:
    assert clickhouse.create_table(CH.live, ORDERS) == (
        "CREATE TABLE IF NOT EXISTS `siphon`.`public__Orders` (`region` String, `id` Int32, `note` Nullable(String), "
        "`_siphon_version` UInt128, `_siphon_deleted` UInt8, `_siphon_synced_at` DateTime64(6, 'UTC')) "
        "ENGINE = ReplacingMergeTree(`_siphon_version`, `_siphon_deleted`) ORDER BY (`region`, `id`)")
    # Only key columns are NOT NULL at Snowflake: a tombstone carries its key and NULL elsewhere.
    assert snowflake.create_table(SF.live, ORDERS) == (
        'CREATE TABLE IF NOT EXISTS "SIPHON"."PUBLIC"."public__Orders" ("region" VARCHAR NOT NULL, '
        '"id" NUMBER(10,0) NOT NULL, "note" VARCHAR, "_siphon_version" NUMBER(29,0) NOT NULL, '
        '"_siphon_deleted" BOOLEAN NOT NULL, "_siphon_synced_at" TIMESTAMP_NTZ(6) NOT NULL)')
    assert clickhouse.create_view(CH) == (
        "CREATE OR REPLACE VIEW `siphon`.`public__Orders_current` AS SELECT `region`, `id`, `note`, "
        "`_siphon_version`, `_siphon_synced_at` FROM `siphon`.`public__Orders` FINAL WHERE `_siphon_deleted` = 0 "
        "AND `_siphon_version` > (SELECT COALESCE(MAX(`_siphon_version`), 0) FROM `siphon`.`public__Orders__truncations`)")
    view = snowflake.create_view(SF)
    assert 'QUALIFY ROW_NUMBER() OVER (PARTITION BY "region", "id" ORDER BY "_siphon_version" DESC) = 1' in view
    assert view.endswith('WHERE "_siphon_deleted" = FALSE AND "_siphon_version" > (SELECT COALESCE(MAX('
                         '"_siphon_version"), 0) FROM "SIPHON"."PUBLIC"."public__Orders__truncations")')


def test_versions_are_bound_as_each_driver_binds_them() -> None:
    version = (0xFFFFFFFF_FFFFFFFF << 32) | 7  # wider than 64 bits
    # ClickHouse: one named parameter, used twice.
    sql, params = clickhouse.tombstone_all(CH.live, ORDERS, version)
    assert params == {"p0": version}
    assert sql.count("{p0:UInt128}") == 2 and "GROUP BY `region`, `id` HAVING max(`_siphon_version`) < {p0:UInt128}" in sql
    # Snowflake: positional, as text cast to a NUMBER wide enough, once per place.
    sql, params = snowflake.tombstone_all(SF.live, ORDERS, version)
    assert params == [str(version), str(version)]
    assert sql.count("CAST(? AS NUMBER(29,0))") == 2 and sql.startswith('UPDATE "SIPHON"."PUBLIC"."public__Orders" SET')
    assert snowflake.record_truncation(SF, 5) == Statement(
        'INSERT INTO "SIPHON"."PUBLIC"."public__Orders__truncations" ("_siphon_version") SELECT CAST(? AS NUMBER(29,0))',
        ["5"])


def test_keys_are_bound_as_text_and_converted_by_the_type_mapping() -> None:
    keys = [("eu", "1"), ("us", "2")]
    sql, params = clickhouse.current_values(CH, keys, ["note"])
    assert params == {"p0": [["eu", "1"], ["us", "2"]]}
    assert sql.endswith("WHERE (`region`, `id`) IN (SELECT k[1], toInt32(k[2]) FROM "
                        "(SELECT arrayJoin({p0:Array(Array(String))}) AS k))")
    sql, params = snowflake.key_rows(SF, keys)
    assert params == ["eu", "1", "us", "2"]
    assert sql.endswith('WHERE ("region", "id") IN ((?, CAST(? AS NUMBER(10,0))), (?, CAST(? AS NUMBER(10,0))))')


def test_bucket_lookups_bind_the_buckets_and_inline_only_the_checked_digit_count() -> None:
    sql, params = clickhouse.bucket_rows(CH, 2, ["0a", "ff"])
    assert params == {"p0": ["0a", "ff"]}
    assert "SUBSTRING(lower(hex(MD5(concat(COALESCE(`region`, ''), char(31), COALESCE(toString(`id`), ''))))), 1, 2) " \
           "IN {p0:Array(String)}" in sql
    sql, params = snowflake.bucket_rows(SF, 2, ["0a", "ff"])
    assert params == ["0a", "ff"]
    assert ('SUBSTRING(MD5(COALESCE("region", \'\') || CHR(31) || COALESCE(CAST("id" AS VARCHAR), \'\')), 1, 2) '
            "IN (?, ?)") in sql
    with pytest.raises(ValueError):
        clickhouse.bucket(ORDERS, "2; DROP TABLE x")  # type: ignore[arg-type]


def test_the_counts_and_changed_keys_around_a_version_are_one_statement_in_either_dialect() -> None:
    statement = clickhouse.changes_around(CH, 9, 100)
    assert statement.params == {"p0": 9}
    assert statement.sql.count("countIf") == 3 and "groupArrayIf(101)" in statement.sql
    # Grouped once, by key, so every figure comes from the same parts of the table.
    assert statement.sql.count(f"FROM {CH.live}") == 1 and "GROUP BY `region`, `id`" in statement.sql
    assert "max_bytes_before_external_group_by" in statement.sql  # a table of many keys spills, never grows
    # The cheaper first read: the view's counts, the tombstones above the version, the keys alone.
    statements = clickhouse.quick_counts(CH, 9)
    assert [s.params for s in statements] == [{"p0": 9}, {"p0": 9}]
    assert [s.sql.count("countIf") for s in statements] == [2, 1]
    assert clickhouse.changed_keys(CH, 9, 100).sql.endswith("LIMIT 101")
    counts, keys = clickhouse.read_changes_around([(5, 2, 1, [["eu", "1"], ["us", "7"]])])
    assert (counts.at_or_below, counts.above, counts.tombstones_above, keys) == (5, 2, 1, [("eu", "1"), ("us", "7")])

    statement = snowflake.changes_around(SF, 9, 100)
    # Bound in the order the text names them: three counts, then the changed keys' two conditions.
    assert statement.params == ["9"] * 5 and statement.sql.count("SUM(CASE WHEN") == 3
    assert statement.sql.count("UNION ALL") == 1 and "LIMIT 101" in statement.sql
    counts, keys = snowflake.read_changes_around([(1, None, None, None, "eu", "1"), (0, 5, 2, 1, None, None)])
    assert (counts.at_or_below, counts.above, counts.tombstones_above, keys) == (5, 2, 1, [("eu", "1")])


def test_a_row_older_than_the_latest_truncate_reads_as_deleted_by_it() -> None:
    rows = [("1", "h1", "10", False, None), ("2", "h2", "5", False, "7"), ("3", "h3", "12", True, "7")]
    assert target_rows(rows, 1) == {
        ("1",): TargetRow("h1", 10, False),
        ("2",): TargetRow(None, 7, True),  # truncated after it was written
        ("3",): TargetRow(None, 12, True),  # a tombstone keeps its version, never its hash
    }


def test_lookups_are_cut_into_statements_of_at_most_the_dialects_size() -> None:
    assert [list(part) for part in chunks(list(range(5)), 2)] == [[0, 1], [2, 3], [4]]
    assert list(chunks([], 500)) == []
    assert (clickhouse.keys_per_lookup, snowflake.keys_per_lookup) == (5000, 500)


def test_both_targets_are_sql_targets_that_keep_the_target_interface() -> None:
    targets = [ClickHouseTarget(ClickHouseTargetConfig(url="http://127.0.0.1:8123", database="siphon")),
               SnowflakeTarget(SnowflakeTargetConfig(account="a", user="u", password="p", database="siphon",
                                                     schema="public"))]
    for target in targets:  # built without connecting: connections open on first use
        assert isinstance(target, SqlTarget) and isinstance(target, Target)
    assert [t.name for t in targets] == ["clickhouse", "snowflake"]
    assert targets[1]._names(ORDERS).live == '"SIPHON"."PUBLIC"."public__Orders"'  # noqa: SLF001
    # The types the checks expect, as each catalog spells them.
    note, key = ORDERS.column("note"), ORDERS.column("id")
    assert [t.expected_column_type(note) for t in targets] == ["Nullable(String)", "VARCHAR"]
    # A column that became NOT NULL at the source stays Nullable at ClickHouse.
    assert targets[0].column_type_matches(SourceColumn("label", 25, "text", nullable=False), "Nullable(String)")
    assert targets[1].column_type_matches(key, "NUMBER(10,0)") and not targets[1].column_type_matches(key, "VARCHAR")


class _PositionalBindings(Bindings):
    def __init__(self) -> None:
        self.params: list[object] = []

    def version(self, value: int) -> str:
        self.params.append(value)
        return "%s::numeric"

    def texts(self, values: Sequence[str]) -> str:
        self.params.append(list(values))
        return "ANY(%s)"


class _ThirdDialect(SqlDialect):
    """Enough of a third target's dialect to build the shared statements: the hooks only."""

    name, keys_per_lookup, separator = "third", 100, "chr(31)"
    meta_types = {"_siphon_version": "numeric(29)", "_siphon_deleted": "boolean", "_siphon_synced_at": "timestamp"}
    meta_constraint = " NOT NULL"
    stage_types = ("text", "text", "boolean")

    def quote(self, identifier: str) -> str:
        return '"' + identifier.replace('"', '""') + '"'

    def md5_hex(self, expression: str) -> str:
        return f"md5({expression})"

    def target_type(self, column: SourceColumn) -> TargetType:
        return mapping_for(column).snowflake if mapping_for(column).snowflake.native else SNOWFLAKE_TEXT

    bindings = _PositionalBindings

    def newest_rows(self, names: TableNames) -> str:
        return f"(SELECT DISTINCT ON ({self.key_order(names.table)}) * FROM {names.live} ORDER BY 1)"

    def as_text(self, expression: str) -> str:
        return f"{expression}::text"

    def stage_reference(self, names: TableNames, name: str) -> str:
        return self.quote(name)

    def key_filter(self, table: TableSchema, keys: Sequence[tuple[str, ...]], bind: Bindings) -> str:
        return f"({self.key_order(table)})::text = {bind.texts(['|'.join(key) for key in keys])}"

    def tombstone_all(self, target: str, table: TableSchema, version: int) -> Statement:
        bind = self.bindings()
        return bind.statement(f"UPDATE {target} SET deleted WHERE v < {bind.version(version)}")

    def swap(self, names: TableNames) -> str:
        return "swap"

    def swap_by_renames(self, names: TableNames, retired: str) -> list[str]:
        return []

    def changes_around(self, names: TableNames, version: int, limit: int) -> Statement:
        return Statement("", [])

    def read_changes_around(self, rows: Sequence[Sequence[object]]) -> tuple[VersionCounts, list[tuple[str, ...]]]:
        return VersionCounts(0, 0, 0), []

    def concat(self, parts: Sequence[str]) -> str:
        return " || ".join(parts)

    def digest_of_hashes(self, hashes: str) -> str:
        return f"md5(string_agg({hashes}, '' ORDER BY {hashes}))"

    def latest_rows(self, names: TableNames, where: str) -> str:
        return f"SELECT * FROM {self.newest_rows(names)} WHERE {where}"


def test_a_third_dialect_writes_only_hooks_and_gets_every_shared_statement() -> None:
    third = _ThirdDialect()
    names = names_of(third, ("db",))
    assert third.create_truncations(names) == (
        'CREATE TABLE IF NOT EXISTS "db"."public__Orders__truncations" ("_siphon_version" numeric(29) NOT NULL)')
    assert third.create_stage('"s"', ORDERS) == (
        'CREATE TABLE "s" ("c0" text, "c1" text, "c2" text, "_v" text, "_d" boolean)')
    assert third.count_older(names, 3) == Statement(
        'SELECT COUNT(*) FROM "db"."public__Orders_current" WHERE "_siphon_version" < %s::numeric', [3])
    assert third.max_version(names) == 'SELECT MAX("_siphon_version")::text FROM "db"."public__Orders"'
    assert third.key_rows(names, [("eu", "1")]).params == [["eu|1"]]


def test_a_clickhouse_snapshot_stage_converts_only_what_its_text_reading_cannot_take() -> None:
    from siphon_dagster.targets.clickhouse_sql import snapshot_input

    table = TableSchema("public", "t", (
        SourceColumn("id", 20, "bigint", nullable=False, primary_key=True),
        SourceColumn("_siphon_text_1", 701, "double precision", nullable=False),  # a name the stage would use
        SourceColumn("blob", 17, "bytea"),
        SourceColumn("flag", 16, "boolean"),
        SourceColumn("at", 1184, "timestamp with time zone"),
    ))
    reading = snapshot_input("`s`", table, (1 << 100) + 3)
    # Integers, booleans and text are read into their columns; the float and the bytes go through
    # text columns of their own, named apart from every source column.
    assert reading.columns == ["id", "__siphon_text_1", "_siphon_text_2", "flag", "at"]
    statement = reading.alteration
    assert statement.startswith("ALTER TABLE `s` ADD COLUMN `__siphon_text_1` Nullable(String) EPHEMERAL, ")
    assert "MODIFY COLUMN `_siphon_text_1` DEFAULT ifNull(toFloat64(`__siphon_text_1`), " in statement
    assert "MODIFY COLUMN `blob` DEFAULT unhex(substring(`_siphon_text_2`, 3))" in statement
    assert f"MODIFY COLUMN `_siphon_version` DEFAULT toUInt128('{(1 << 100) + 3}')" in statement
    assert "`flag`" not in statement and "`at`" not in statement and "_siphon_deleted" not in statement
