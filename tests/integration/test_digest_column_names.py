"""The checks' digests of a table whose columns are named like the short aliases a digest query could
use (v, d, h, b, k0): each target hashes every row as PostgreSQL does, and reads the keys changed
after a version. Real PostgreSQL, the embedded ClickHouse and fakesnow."""

from __future__ import annotations

import pyarrow as pa
import pytest

from siphon_dagster import source
from siphon_dagster.checks import source_digest
from siphon_dagster.targets.base import VERSION_ARROW_TYPE, change_batch_schema
from tests.helpers.application import Application
from tests.integration.test_targets_version_rule import make_target

ROWS = 50
VERSION = 1000


@pytest.mark.parametrize("name", ["clickhouse", "snowflake"])
def test_digests_of_columns_named_like_query_aliases(request: pytest.FixtureRequest, app: Application,
                                                     unique_name: str, name: str) -> None:
    app.sql("create table {schema}.aliased (id integer primary key, v text, d integer, h text, b text, k0 text)")
    app.sql("insert into {schema}.aliased select g, 'v' || g, g * 2, 'h' || g, null, 'k' || g "
            f"from generate_series(1, {ROWS}) g")
    table = app.table_schema("aliased")
    keys = [(str(i),) for i in range(1, ROWS + 1)]
    with source.connect(app.dsn) as connection:
        expected = {key: row.hash for key, row in source_digest.key_rows(connection, table, keys).items()}
        expected_buckets = source_digest.bucket_digests(connection, table, 1)
    rows = app.rows_as_text(table)
    columns = [pa.array([row[i] for row in rows], pa.string()) for i in range(len(table.columns))]
    columns += [pa.array([VERSION] * len(rows), VERSION_ARROW_TYPE), pa.array([False] * len(rows), pa.bool_())]

    target = make_target(request, name, unique_name)
    try:
        target.ensure_table(table)
        target.apply_rows(table, pa.Table.from_arrays(columns, schema=change_batch_schema(table)))
        stored = target.key_rows(table, keys)
        assert {key: row.hash for key, row in stored.items()} == expected
        assert target.bucket_digests(table, 1) == expected_buckets
        assert {key: row.hash for key, row in target.bucket_rows(table, 1, sorted(expected_buckets)).items()} \
            == expected
        changes = target.changes_around(table, VERSION - 1, ROWS)
        assert sorted(changes.changed_keys or []) == sorted(keys)
        assert (changes.counts.at_or_below, changes.counts.above, changes.counts.tombstones_above) == (0, ROWS, 0)
        assert target.changes_around(table, VERSION - 1, 10).changed_keys is None  # more than the limit
        unchanged = target.changes_around(table, VERSION, ROWS)
        assert unchanged.changed_keys == [] and unchanged.counts.at_or_below == ROWS
    finally:
        target.drop_table(table)
        target.close()
