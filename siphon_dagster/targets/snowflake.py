"""The Snowflake target: one row per key, kept by a version-guarded MERGE from a staged batch.

Batches are staged as text in a temporary table and converted by Snowflake itself with the type
mapping's expressions, so the stream and snapshots share one conversion. A batch reaches that table
as Parquet files through a temporary stage and a COPY (`snowflake_stage`), or, when it is small or
the role may not create a stage, as INSERT ... VALUES. The lifecycle is `sql_target.SqlTarget`'s;
this module is Snowflake's hooks.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain, islice
from pathlib import Path
from typing import Any

import pyarrow as pa
import snowflake.connector
from snowflake.connector.errors import Error as SnowflakeError

from siphon_core.config import SnowflakeTargetConfig
from siphon_core.logs import get_logger
from siphon_dagster.targets import snowflake_sql as sql
from siphon_dagster.targets import snowflake_stage as stage
from siphon_dagster.targets.base import META_COLUMNS, SHADOW_SUFFIX, SchemaChange, SourceColumn, TargetError
from siphon_dagster.targets.copy_text import iter_copy_rows
from siphon_dagster.targets.names import TableNames
from siphon_dagster.targets.snowflake_key import load_private_key
from siphon_dagster.targets.sql_target import SqlTarget, StoredColumn
from siphon_dagster.targets.thread_connections import ConnectionPerThread
from siphon_dagster.targets.type_mapping import mapping_for, snowflake_type

# Rows per INSERT ... VALUES statement into the stage, and an upper bound on its bind parameters.
STAGE_ROWS_PER_STATEMENT = 1000
MAX_BINDS_PER_STATEMENT = 16000
# A batch of at most this many rows (and MAX_BINDS_PER_STATEMENT values) goes in its MERGE's
# VALUES: one statement per target, where a staging table costs a CREATE, an INSERT and a DROP
# more, each a round trip and a compile. Most batches of a run serving many tables are this small.
VALUES_MAX_ROWS = 100

_log = get_logger("targets.snowflake")


class SnowflakeTarget(SqlTarget):
    dialect = sql.dialect
    driver_error = SnowflakeError

    def __init__(self, config: SnowflakeTargetConfig, shared: ConnectionPerThread | None = None) -> None:
        self.database = sql.configured_identifier(config.database)
        self.schema = sql.configured_identifier(config.schema_)
        self.namespace = (self.database, self.schema)
        self.config = config
        self._own_session: dict[str, Any] = {}  # what lives with this target's own connection
        self._shared = shared  # the connections of the target this one is a sibling of
        self._sibling_connections: ConnectionPerThread | None = None  # what this target's siblings share

    def sibling(self) -> SnowflakeTarget:
        """A target of the same account for another table of a streaming run: its statements go
        through connections shared by every sibling, one per thread, each a session with its own
        temporary stage. A run of hundreds of tables logs in as many times as it has threads."""
        if self._sibling_connections is None:
            self._sibling_connections = ConnectionPerThread(self._open, is_open=_session_open)
        sibling = SnowflakeTarget(self.config, shared=self._sibling_connections)
        self._share_shadow_lookups(sibling)
        return sibling

    # -- connection ------------------------------------------------------------------------------

    def _connect(self) -> Any:
        return self._shared.connection() if self._shared is not None else super()._connect()

    def _session(self) -> dict[str, Any]:
        """Values of the session the next statement runs in (its temporary stage, once made)."""
        if self._shared is not None:
            return self._shared.session()
        self._connect()
        return self._own_session

    def _open(self) -> Any:
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
        return connection

    def close(self) -> None:
        if self._shared is not None:
            return  # the connections belong to the target this one is a sibling of
        super().close()
        self._own_session.clear()  # a temporary stage ends with its connection
        if self._sibling_connections is not None:
            self._sibling_connections.close()
            self._sibling_connections = None

    @property
    def location(self) -> str:
        if self.config.host:
            where = f"{self.config.protocol or 'https'}://{self.config.host}{f':{self.config.port}' if self.config.port else ''}"
        else:
            where = f"https://{self.config.account}.snowflakecomputing.com"
        return f"{where} (database {self.database}, schema {self.schema})"

    def _run(self, statement: str, params: Any) -> Any:
        try:
            cursor = self._connect().cursor()
            cursor.execute(statement, params)
        except SnowflakeError as error:
            if _session_gone(error):
                self._drop_session()  # the batch fails; its retry logs in again
            raise
        return cursor

    def _drop_session(self) -> None:
        if self._shared is not None:
            self._shared.discard()
            return
        connection, self._connection = self._connection, None
        self._own_session.clear()
        if connection is not None:
            with contextlib.suppress(SnowflakeError):
                connection.close()

    def _query(self, statement: str, params: Any) -> list:
        return self._run(statement, params).fetchall()

    def _stored_columns(self, names: TableNames, name: str) -> list[StoredColumn]:
        rows = self._fetch(
            names,
            "reading columns",
            f"SELECT column_name, data_type, numeric_precision, numeric_scale, is_nullable "
            f"FROM {sql.quote(self.database)}.information_schema.columns "
            "WHERE table_schema = ? AND table_name = ? ORDER BY ordinal_position",
            (self.schema, name),
        )
        # Only key columns are NOT NULL (besides Siphon's own), so they tell the stored key.
        return [
            StoredColumn(column, sql.normalized_type(kind, precision, scale),
                         nullable != "YES" and column not in META_COLUMNS)
            for column, kind, precision, scale, nullable in rows
        ]

    def _listed_shadows(self, names: TableNames) -> set[str] | None:
        # One catalog read answers a run's hundreds of tables for `shadow_lookup_seconds`, where a
        # look-up of each table's columns cost most of its batches a statement of their own.
        rows = self._fetch(
            names,
            "looking for resync tables",
            f"SELECT table_name FROM {sql.quote(self.database)}.information_schema.tables WHERE table_schema = ?",
            (self.schema,),
        )
        return {name for (name,) in rows if name.endswith(SHADOW_SUFFIX)}

    # -- schema changes --------------------------------------------------------------------------

    def _follow_column(self, names: TableNames, targets: Sequence[str], column: SourceColumn,
                       current: str | None, change: SchemaChange, backfill: str | None) -> bool:
        expected = sql.declared_type(snowflake_type(column))
        if current is None:
            for target in targets:
                self._add_column(names, target, column, backfill)
            change.added_columns.append(column.name)
        elif _widens(current, expected):
            # Snowflake raises a NUMBER's precision in place, keys included (int4 -> int8).
            for target in targets:
                self._execute(names, f"widening column {column.name!r}",
                              f"ALTER TABLE {target} ALTER COLUMN {sql.quote(column.name)} SET DATA TYPE {expected}")
        elif current != expected:
            change.incompatible.append(
                f"{column.name}: source type {column.type_name} maps to {expected}, the table has {current}"
            )
            return False
        return current != expected

    def _add_column(self, names: TableNames, target: str, column: SourceColumn, backfill: str | None) -> None:
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

    # -- loads -----------------------------------------------------------------------------------

    def _fill_staging_table(self, names: TableNames, staging: str, batches: Iterable[pa.Table]) -> int:
        """Fills the staging table with staging batches (`sql_dialect.staging_names`); returns
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

    def _insert_rows(self, names: TableNames, staging: str, rows: Iterable[list[Any]]) -> int:
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

    def _copy_files(self, names: TableNames, staging: str, load_stage: str, batches: Iterable[pa.Table]) -> int:
        """Parquet files, each PUT to a directory of the stage once written (and deleted here), then
        one COPY of the directory into the staging table."""
        directory = stage.new_load_directory()

        def ship(path: Path) -> None:
            self._execute(names, "uploading a batch file", stage.put(path, load_stage, directory))
            path.unlink()

        with stage.local_load_directory(self.config.stage_directory) as local:
            files = stage.ParquetFiles(local, ship)
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

    def _stage_for_load(self, names: TableNames) -> str | None:
        """The temporary stage of the connection the next statement runs on, created on first use;
        None when the role may not create one here (then every load of this process into this
        schema uses INSERT, said once)."""
        if stage.stage_refused(self._location()):
            return None
        session = self._session()
        if "load_stage" not in session:
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
            session["load_stage"] = name
        return session["load_stage"]

    def _create_load_stage(self, name: str) -> None:
        self._statements += 1
        self._run(stage.create_stage(name), None)

    def _write_batch(self, names: TableNames, rows: pa.Table, targets: Sequence[str]) -> None:
        width = len(names.table.columns) + 2
        limit = min(VALUES_MAX_ROWS, MAX_BINDS_PER_STATEMENT // width, self.config.stage_min_rows - 1)
        if rows.num_rows > limit:
            super()._write_batch(names, rows, targets)
            return
        params = [value for row in stage.staged_rows([stage.staging_batch(names.table, rows)]) for value in row]
        source = sql.values_source(names.table, rows.num_rows)
        self.last_load_path = stage.VALUES_PATH
        self._write_each(names, targets, lambda target: self._execute(
            names, "merging a batch", sql.merge(target, source, names.table), params))

    def _load_batch(self, names: TableNames, staging: str, rows: pa.Table) -> None:
        self._fill_staging_table(names, staging, [stage.staging_batch(names.table, rows)])

    def _apply_staged(self, names: TableNames, target: str, staging: str) -> None:
        self._execute(names, "merging a batch", sql.merge(target, staging, names.table))

    def _load_snapshot(self, names: TableNames, chunks: Iterable[bytes], version: int, targets: Sequence[str]) -> int:
        width = len(names.table.columns)

        def checked_rows() -> Iterator[list[str | None]]:
            for number, values in enumerate(iter_copy_rows(chunks), start=1):
                if len(values) != width:
                    raise TargetError(
                        names.describe(f"COPY row {number} has {len(values)} fields, the table has {width} columns")
                    )
                yield values

        # Rows stream from the chunks into the staging table; the MERGE then runs inside Snowflake.
        with self._staging_table(names) as staging:
            count = self._fill_staging_table(names, staging, stage.copy_text_batches(names.table, checked_rows(), version))
            self._write_staged(names, staging, targets)
        return count


def _session_open(connection: Any) -> bool:
    return not connection.is_closed() and not getattr(connection, "expired", False)


def _session_gone(error: SnowflakeError) -> bool:
    """A connection exception (SQLSTATE class 08): the connection is closed, its session expired
    beyond renewal, or it cannot reach the account. Another session may succeed where this one
    cannot."""
    return str(error.sqlstate or "").startswith("08")


_NUMBER = re.compile(r"NUMBER\((\d+),(\d+)\)")


def _widens(current: str, expected: str) -> bool:
    """A NUMBER of the same scale and a greater precision: every stored value fits it."""
    stored, wanted = _NUMBER.fullmatch(current), _NUMBER.fullmatch(expected)
    return bool(stored and wanted and stored.group(2) == wanted.group(2) and int(wanted.group(1)) > int(stored.group(1)))
