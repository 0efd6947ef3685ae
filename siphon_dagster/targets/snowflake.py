"""The Snowflake target: one row per key, kept by a version-guarded MERGE from a staged batch.

Batches are staged as text in a temporary table and converted by Snowflake itself with the type
mapping's expressions, so the stream and snapshots share one conversion. A batch reaches that table
as Parquet files through a temporary stage and a COPY (`snowflake_stage`), or, when it is small or
the role may not create a stage, as INSERT ... VALUES.
"""

from __future__ import annotations

import re
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from itertools import chain, islice
from pathlib import Path
from typing import Any

import pyarrow as pa
import snowflake.connector
from snowflake.connector.errors import Error as SnowflakeError

from siphon_core.config import SnowflakeTargetConfig
from siphon_core.logs import get_logger
from siphon_dagster.targets import snowflake_digest as digest
from siphon_dagster.targets import snowflake_sql as sql
from siphon_dagster.targets import snowflake_stage as stage
from siphon_dagster.targets.base import (
    BucketDigest,
    SchemaChange,
    SourceColumn,
    TableSchema,
    TargetColumn,
    TargetError,
    TargetRow,
    VersionCounts,
    change_batch_schema,
)
from siphon_dagster.targets.copy_text import iter_copy_rows
from siphon_dagster.targets.snowflake_key import load_private_key
from siphon_dagster.targets.type_mapping import mapping_for, snowflake_type

# Rows per INSERT ... VALUES statement into the stage, and an upper bound on its bind parameters.
STAGE_ROWS_PER_STATEMENT = 1000
MAX_BINDS_PER_STATEMENT = 16000
# Keys per lookup statement in read_current_values.
KEYS_PER_LOOKUP = 500

_log = get_logger("targets.snowflake")


class SnowflakeTarget:
    name = "snowflake"

    def __init__(self, config: SnowflakeTargetConfig) -> None:
        self.config = config
        self.database = sql.configured_identifier(config.database)
        self.schema = sql.configured_identifier(config.schema_)
        self._connection: Any = None
        self._load_stage: str | None = None  # this connection's temporary stage, once created
        self._statements = 0
        # How the last apply reached the staging table ("stage" or "insert"), and the statements
        # it ran: the streaming report and the benchmarks read them.
        self.last_load_path: str | None = None
        self.last_load_statements = 0

    # -- connection ------------------------------------------------------------------------------

    def _connect(self) -> Any:
        if self._connection is None:
            options: dict[str, Any] = {
                "account": self.config.account,
                "user": self.config.user,
                "paramstyle": "qmark",  # server-side binding: values never become SQL text
                "autocommit": True,
            }
            if self.config.private_key_file is not None:
                options["private_key"] = load_private_key(self.config.private_key_file,
                                                          self.config.private_key_passphrase)
            else:
                options["password"] = self.config.password
            for key in ("warehouse", "role", "host", "port", "protocol"):
                if getattr(self.config, key) is not None:
                    options[key] = getattr(self.config, key)
            try:
                connection = snowflake.connector.connect(**options)
                cursor = connection.cursor()
                cursor.execute(f"CREATE DATABASE IF NOT EXISTS {sql.quote(self.database)}")
                schema = f"{sql.quote(self.database)}.{sql.quote(self.schema)}"
                cursor.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
                # Temporary stage tables are created unqualified, in the connection's current schema.
                cursor.execute(f"USE SCHEMA {schema}")
            except SnowflakeError as error:
                raise TargetError(
                    f"snowflake: cannot open {self.database}.{self.schema} as {self.config.user}@{self.config.account}: "
                    f"{error}; check targets.snowflake in siphon.yaml and the account's privileges"
                ) from error
            self._connection = connection
        return self._connection

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
            self._load_stage = None  # a temporary stage ends with its connection

    def _names(self, table: TableSchema) -> sql.TableNames:
        return sql.TableNames(table=table, database=self.database, schema=self.schema)

    def _execute(self, names: sql.TableNames, what: str, statement: str, params: Sequence[Any] | None = None) -> Any:
        cursor = self._connect().cursor()
        self._statements += 1
        try:
            cursor.execute(statement, params)
        except SnowflakeError as error:
            raise TargetError(names.describe(f"{what} failed: {error}")) from error
        return cursor

    def _fetch(self, names: sql.TableNames, what: str, statement: str, params: Sequence[Any] | None = None) -> list:
        return self._execute(names, what, statement, params).fetchall()

    # -- tables ----------------------------------------------------------------------------------

    def _table_columns(self, names: sql.TableNames, table_name: str) -> list[TargetColumn]:
        return [TargetColumn(name, kind) for name, kind, _nullable in self._column_rows(names, table_name)]

    def _column_rows(self, names: sql.TableNames, table_name: str) -> list[tuple[str, str, bool]]:
        rows = self._fetch(
            names,
            "reading columns",
            f"SELECT column_name, data_type, numeric_precision, numeric_scale, is_nullable "
            f"FROM {sql.quote(self.database)}.information_schema.columns "
            "WHERE table_schema = ? AND table_name = ? ORDER BY ordinal_position",
            (self.schema, table_name),
        )
        return [
            (name, sql.normalized_type(kind, precision, scale), nullable == "YES")
            for name, kind, precision, scale, nullable in rows
        ]

    def _shadow_exists(self, names: sql.TableNames) -> bool:
        rows = self._fetch(
            names,
            "looking for a resync table",
            f"SELECT COUNT(*) FROM {sql.quote(self.database)}.information_schema.tables "
            "WHERE table_schema = ? AND table_name = ?",
            (self.schema, names.shadow_name),
        )
        return bool(rows[0][0])

    def ensure_table(self, table: TableSchema, backfill: Mapping[str, str] | None = None) -> SchemaChange:
        sql.check_columns(table)
        names = self._names(table)
        change = SchemaChange()
        rows = self._column_rows(names, names.table_name)
        existing = {name: kind for name, kind, _nullable in rows}
        if not existing:
            self._execute(names, "creating the table", sql.create_table(names.live, table))
            change.created = True
        else:
            # Only key columns are NOT NULL (besides Siphon's own), so they tell the stored key.
            stored_key = sorted(name for name, _kind, nullable in rows if not nullable and name not in sql.META_TYPES)
            source_key = sorted(c.name for c in table.key_columns)
            if stored_key != source_key:
                change.incompatible.append(
                    f"primary key: the source's is {source_key}, the table's is {stored_key}"
                )
            targets = self._write_targets(names)
            backfill = backfill or {}
            for column in table.columns:
                expected = sql.declared_type(snowflake_type(column))
                if column.name not in existing:
                    for target in targets:
                        self._add_column(names, target, column, backfill.get(column.name))
                    change.added_columns.append(column.name)
                elif _widens(existing[column.name], expected):
                    # Snowflake raises a NUMBER's precision in place, keys included (int4 -> int8).
                    for target in targets:
                        self._execute(names, f"widening column {column.name!r}",
                                      f"ALTER TABLE {target} ALTER COLUMN {sql.quote(column.name)} "
                                      f"SET DATA TYPE {expected}")
                elif existing[column.name] != expected:
                    change.incompatible.append(
                        f"{column.name}: source type {column.type_name} maps to {expected}, "
                        f"the table has {existing[column.name]}"
                    )
        view = [c.name for c in self._table_columns(names, names.view_name)]
        if view != sql.view_columns(table):
            # New table, new or dropped source columns: the view lists exactly the source's columns.
            self._execute(names, "creating the truncations table", sql.create_truncations(names))
            self._execute(names, "creating the current-rows view", sql.create_view(names))
        return change

    def _add_column(self, names: sql.TableNames, target: str, column: SourceColumn, backfill: str | None) -> None:
        """Adds a source column, nullable (a new column cannot join the key); rows already in the
        table hold `backfill` in it, or NULL.

        Snowflake commits each DDL statement on its own: the column is filled under a working name
        and renamed once filled, so it never appears unfilled; a crash in between leaves only the
        working column, which the next attempt drops. The value is a bind parameter converted by
        the type mapping, as in a MERGE.
        """
        what = f"adding column {column.name!r}"
        if backfill is None:
            self._execute(names, what, f"ALTER TABLE {target} ADD COLUMN {sql.quote(column.name)} {snowflake_type(column)}")
            return
        working = sql.quote(sql.backfill_column_name(column.name))
        self._execute(names, what, f"ALTER TABLE {target} DROP COLUMN IF EXISTS {working}")
        self._execute(names, what, f"ALTER TABLE {target} ADD COLUMN {working} {snowflake_type(column)}")
        self._execute(names, f"filling column {column.name!r} of existing rows",
                      f"UPDATE {target} SET {working} = {mapping_for(column).snowflake.convert('?')}", (backfill,))
        self._execute(names, what, f"ALTER TABLE {target} RENAME COLUMN {working} TO {sql.quote(column.name)}")

    def describe_columns(self, table: TableSchema) -> list[TargetColumn]:
        names = self._names(table)
        return self._table_columns(names, names.table_name)

    def drop_table(self, table: TableSchema) -> None:
        names = self._names(table)
        self._execute(names, "dropping the view", f"DROP VIEW IF EXISTS {names.view}")
        for target in (names.live, names.shadow, names.truncations):
            self._execute(names, "dropping a table", f"DROP TABLE IF EXISTS {target}")

    # -- writes ----------------------------------------------------------------------------------

    @contextmanager
    def _staging_table(self, names: sql.TableNames) -> Iterator[str]:
        staging = f"siphon_stage_{uuid.uuid4().hex}"
        self._execute(names, "creating a stage table", sql.create_stage(staging, names.table))
        try:
            yield staging
        finally:
            self._execute(names, "dropping a stage table", f"DROP TABLE IF EXISTS {sql.quote(staging)}")

    def _fill_staging_table(self, names: sql.TableNames, staging: str, batches: Iterable[pa.Table]) -> int:
        """Fills the staging table with staging batches (`snowflake_stage.staging_names`); returns
        the rows staged. Through files when there are at least `stage_min_rows` rows and the role
        may create a stage, otherwise with INSERT."""
        iterator = iter(batches)
        head: list[pa.Table] = []
        rows = 0
        for batch in iterator:
            head.append(batch)
            rows += batch.num_rows
            if rows >= self.config.stage_min_rows:
                break
        batches = chain(head, iterator)
        load_stage = self._stage_for_load(names) if rows >= max(1, self.config.stage_min_rows) else None
        if load_stage is None:
            self.last_load_path = stage.INSERT_PATH
            return self._insert_rows(names, staging, stage.staged_rows(batches))
        self.last_load_path = stage.STAGE_PATH
        return self._copy_files(names, staging, load_stage, batches)

    def _insert_rows(self, names: sql.TableNames, staging: str, rows: Iterable[list[Any]]) -> int:
        width = len(names.table.columns) + 2
        per_statement = max(1, min(STAGE_ROWS_PER_STATEMENT, MAX_BINDS_PER_STATEMENT // width))
        # One multi-row INSERT per slice: a few round trips per batch, and never more than one slice
        # of rows held here.
        total = 0
        iterator = iter(rows)
        while batch := list(islice(iterator, per_statement)):
            params = [value for row in batch for value in row]
            self._execute(names, "staging rows", sql.insert_stage(staging, names.table, len(batch)), params)
            total += len(batch)
        return total

    def _copy_files(self, names: sql.TableNames, staging: str, load_stage: str, batches: Iterable[pa.Table]) -> int:
        """Parquet files, each PUT to a directory of the stage once written (and deleted here), then
        one COPY of the directory into the staging table."""
        directory = stage.new_load_directory()

        def ship(path: Path) -> None:
            self._execute(names, "uploading a batch file", stage.put(path, load_stage, directory))
            path.unlink()

        with tempfile.TemporaryDirectory(prefix="siphon-load-", dir=self.config.stage_directory) as local:
            files = stage.ParquetFiles(Path(local), ship)
            try:
                for batch in batches:
                    files.write(batch)
                files.finish()
            finally:
                files.abandon()
        # A COPY that fails leaves its files in the stage, which ends with the connection.
        results = self._fetch(names, "copying staged files into the stage table",
                              stage.copy_into(staging, names.table, load_stage, directory))
        loaded = sum(int(result[3]) for result in results)
        if loaded != files.rows:
            raise TargetError(names.describe(
                f"COPY loaded {loaded} rows of {files.rows} from {files.files} staged files: {results}"))
        return files.rows

    def _location(self) -> tuple[str, ...]:
        return (self.config.account, self.config.user, self.config.role or "", self.database, self.schema)

    def _stage_for_load(self, names: sql.TableNames) -> str | None:
        """This connection's temporary stage, created on first use; None when the role may not create
        one here (then every load of this process into this schema uses INSERT, said once)."""
        if stage.stage_refused(self._location()):
            return None
        if self._load_stage is None:
            name = stage.new_stage_name()
            try:
                self._create_load_stage(name)
            except SnowflakeError as error:
                if not stage.is_missing_stage_privilege(error):
                    raise TargetError(names.describe(f"creating a load stage failed: {error}")) from error
                if stage.refuse_stage(self._location()):
                    schema = f"{sql.quote(self.database)}.{sql.quote(self.schema)}"
                    role = self.config.role or f"the default role of {self.config.user}"
                    grantee = sql.quote(self.config.role) if self.config.role else "<role>"
                    _log.warning(
                        f"snowflake: {role} lacks CREATE STAGE on schema {schema}; loading with INSERT from now "
                        f"on, which is much slower for large batches; grant it with GRANT CREATE STAGE ON "
                        f"SCHEMA {schema} TO ROLE {grantee}",
                        error=str(error).splitlines()[0],
                    )
                return None
            self._load_stage = name
        return self._load_stage

    def _create_load_stage(self, name: str) -> None:
        self._statements += 1
        self._connect().cursor().execute(stage.create_stage(name))

    def _merge(self, names: sql.TableNames, staging: str, targets: Sequence[str]) -> None:
        self._write_each(names, targets,
                         lambda target: self._execute(names, "merging a batch", sql.merge(target, staging, names.table)))

    def _write_targets(self, names: sql.TableNames) -> list[str]:
        # The resync table first, then the live one: a swap between the two writes leaves the rows
        # in the table that ends up live either way (see siphon_dagster.resync).
        return ([names.shadow] if self._shadow_exists(names) else []) + [names.live]

    def _write_each(self, names: sql.TableNames, targets: Sequence[str], write: Callable[[str], object]) -> None:
        for target in targets:
            try:
                write(target)
            except TargetError:
                # The resync table went (swapped in and dropped, or abandoned) after it was looked
                # up: the live write that follows reaches the table that is live now.
                if target == names.shadow and not self._shadow_exists(names):
                    continue
                raise

    def apply_rows(self, table: TableSchema, rows: pa.Table) -> int:
        if rows.num_rows == 0:
            return 0
        names = self._names(table)
        expected = change_batch_schema(table)
        if rows.schema.names != expected.names:
            raise TargetError(names.describe(f"batch columns {rows.schema.names} differ from {expected.names}"))
        started = self._statements
        with self._staging_table(names) as staging:
            self._fill_staging_table(names, staging, [stage.staging_batch(table, rows)])
            self._merge(names, staging, self._write_targets(names))
        self.last_load_statements = self._statements - started
        return rows.num_rows

    def apply_copy_text(
        self, table: TableSchema, chunks: Iterable[bytes], version: int, *, shadow: bool = False
    ) -> int:
        names = self._names(table)
        width = len(table.columns)

        def checked_rows() -> Iterator[list[str | None]]:
            for number, values in enumerate(iter_copy_rows(chunks), start=1):
                if len(values) != width:
                    raise TargetError(
                        names.describe(f"COPY row {number} has {len(values)} fields, the table has {width} columns")
                    )
                yield values

        started = self._statements
        targets = [names.shadow] if shadow else self._write_targets(names)
        # Rows stream from the chunks into the staging table; the MERGE then runs inside Snowflake.
        with self._staging_table(names) as staging:
            count = self._fill_staging_table(names, staging, stage.copy_text_batches(table, checked_rows(), version))
            self._merge(names, staging, targets)
        self.last_load_statements = self._statements - started
        return count

    def tombstone_all(self, table: TableSchema, version: int) -> int:
        names = self._names(table)
        count = self._fetch(
            names,
            "counting rows to tombstone",
            f"SELECT COUNT(*) FROM {names.view} WHERE {sql.quote(sql.VERSION_COLUMN)} < CAST(? AS {sql.VERSION_TYPE})",
            (str(version),),
        )[0][0]
        self._write_each(names, self._write_targets(names), lambda target: self._execute(
            names, "tombstoning every row", sql.tombstone_all(target), (str(version), str(version))))
        self._execute(names, "recording the truncate", sql.record_truncation(names), (str(version),))
        return int(count)

    # -- reads -----------------------------------------------------------------------------------

    def read_current_values(
        self, table: TableSchema, keys: Sequence[tuple[str, ...]], columns: Sequence[str]
    ) -> dict[tuple[str, ...], dict[str, str | None]]:
        names = self._names(table)
        key_names = [c.name for c in table.key_columns]
        selected = sql.rendered_columns(table, key_names + list(columns))
        found: dict[tuple[str, ...], dict[str, str | None]] = {}
        for start in range(0, len(keys), KEYS_PER_LOOKUP):
            part = keys[start : start + KEYS_PER_LOOKUP]
            params = [value for key in part for value in key]
            rows = self._fetch(
                names,
                "reading current values",
                f"SELECT {', '.join(selected)} FROM {names.view} WHERE {sql.key_filter(table, len(part))}",
                params,
            )
            for row in rows:
                key = tuple(row[: len(key_names)])
                found[key] = dict(zip(columns, row[len(key_names) :], strict=True))
        return found

    def current_rows_as_text(self, table: TableSchema) -> list[tuple[str | None, ...]]:
        names = self._names(table)
        selected = sql.rendered_columns(table, list(table.column_names))
        rows = self._fetch(
            names,
            "reading current rows",
            f"SELECT {', '.join(selected)} FROM {names.view} ORDER BY {sql.key_order(table)}",
        )
        return [tuple(row) for row in rows]

    def count_current(self, table: TableSchema) -> int:
        names = self._names(table)
        return int(self._fetch(names, "counting current rows", f"SELECT COUNT(*) FROM {names.view}")[0][0])

    def max_version(self, table: TableSchema) -> int:
        names = self._names(table)
        statement = f"SELECT CAST(MAX({sql.quote(sql.VERSION_COLUMN)}) AS VARCHAR) FROM {names.live}"
        value = self._fetch(names, "reading the greatest version", statement)[0][0]
        return int(value) if value is not None else 0

    # -- checks ----------------------------------------------------------------------------------

    @property
    def location(self) -> str:
        if self.config.host:
            where = f"{self.config.protocol or 'https'}://{self.config.host}{f':{self.config.port}' if self.config.port else ''}"
        else:
            where = f"https://{self.config.account}.snowflakecomputing.com"
        return f"{where} (database {self.database}, schema {self.schema})"

    def expected_column_type(self, column: SourceColumn) -> str:
        return sql.declared_type(snowflake_type(column))

    def column_type_matches(self, column: SourceColumn, stored: str) -> bool:
        return stored == self.expected_column_type(column)

    def version_counts(self, table: TableSchema, version: int) -> VersionCounts:
        names = self._names(table)
        bound = str(version)
        below, above, tombstones = self._fetch(names, "counting rows around a version",
                                               digest.version_counts(names), (bound, bound, bound))[0]
        return VersionCounts(int(below), int(above), int(tombstones))

    def bucket_digests(self, table: TableSchema, digits: int) -> dict[str, BucketDigest]:
        names = self._names(table)
        rows = self._fetch(names, "computing bucket digests", digest.bucket_digests(names, digits))
        return {bucket: BucketDigest(int(count), value) for bucket, count, value in rows}

    def bucket_rows(self, table: TableSchema, digits: int,
                    buckets: Sequence[str]) -> dict[tuple[str, ...], TargetRow]:
        names = self._names(table)
        found: dict[tuple[str, ...], TargetRow] = {}
        for start in range(0, len(buckets), KEYS_PER_LOOKUP):
            part = list(buckets[start : start + KEYS_PER_LOOKUP])
            statement = digest.latest_rows(names, digest.bucket_filter(table, digits, len(part)))
            found.update(digest.target_rows(self._fetch(names, "reading rows of buckets", statement, part),
                                            len(table.key_columns)))
        return found

    def key_rows(self, table: TableSchema, keys: Sequence[tuple[str, ...]]) -> dict[tuple[str, ...], TargetRow]:
        names = self._names(table)
        found: dict[tuple[str, ...], TargetRow] = {}
        for start in range(0, len(keys), KEYS_PER_LOOKUP):
            part = keys[start : start + KEYS_PER_LOOKUP]
            statement = digest.latest_rows(names, sql.key_filter(table, len(part)))
            params = [value for key in part for value in key]
            found.update(digest.target_rows(self._fetch(names, "reading rows by key", statement, params),
                                            len(table.key_columns)))
        return found

    def rows_after(self, table: TableSchema, version: int, limit: int) -> dict[tuple[str, ...], TargetRow]:
        names = self._names(table)
        statement = f"{digest.latest_rows(names, digest.changed_after(names))} LIMIT {int(limit) + 1}"
        rows = self._fetch(names, "reading rows changed after a version", statement, (str(version), str(version)))
        return digest.target_rows(rows, len(table.key_columns))

    # -- resync ----------------------------------------------------------------------------------

    def create_shadow(self, table: TableSchema) -> None:
        sql.check_columns(table)
        names = self._names(table)
        self._execute(names, "dropping an old resync table", f"DROP TABLE IF EXISTS {names.shadow}")
        self._execute(names, "creating the resync table", sql.create_table(names.shadow, table))

    def swap_shadow(self, table: TableSchema) -> None:
        names = self._names(table)
        if not self._shadow_exists(names):
            raise TargetError(names.describe("no resync table to swap in; run create_shadow first"))
        try:
            # One atomic step on Snowflake: readers of the view see the old or the new table.
            self._connect().cursor().execute(f"ALTER TABLE {names.live} SWAP WITH {names.shadow}")
        except SnowflakeError:
            # Snowflake-compatible engines without SWAP WITH (fakesnow): three renames.
            retired = names.qualified(f"{names.table_name}__retired_{uuid.uuid4().hex[:8]}")
            self._execute(names, "retiring the live table", f"ALTER TABLE {names.live} RENAME TO {retired}")
            self._execute(names, "renaming the resync table", f"ALTER TABLE {names.shadow} RENAME TO {names.live}")
            self._execute(names, "renaming the retired table", f"ALTER TABLE {retired} RENAME TO {names.shadow}")
        self._execute(names, "dropping the previous table", f"DROP TABLE IF EXISTS {names.shadow}")
        self._execute(names, "recreating the current-rows view", sql.create_view(names))

    def drop_shadow(self, table: TableSchema) -> None:
        names = self._names(table)
        self._execute(names, "dropping the resync table", f"DROP TABLE IF EXISTS {names.shadow}")


_NUMBER = re.compile(r"NUMBER\((\d+),(\d+)\)")


def _widens(current: str, expected: str) -> bool:
    """A NUMBER of the same scale and a greater precision: every stored value fits it."""
    stored, wanted = _NUMBER.fullmatch(current), _NUMBER.fullmatch(expected)
    return bool(stored and wanted and stored.group(2) == wanted.group(2) and int(wanted.group(1)) > int(stored.group(1)))
