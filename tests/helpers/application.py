"""One producer application per test: a schema of its own in the source, an application
identifier of its own (so its own slot, publication and stream), its producers, and the clean-up."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from psycopg import sql

from siphon_core import naming
from siphon_core.config import TableConfig
from siphon_dagster import source
from siphon_dagster.targets.base import TableSchema
from tests.helpers import stream
from tests.helpers.producer import ProducerProcess, drop_application, execute, producer_config


@dataclass
class Application:
    dsn: str
    nats_url: str
    identifier: str
    schema: str
    directory: Path
    producers: list[ProducerProcess] = field(default_factory=list)

    @property
    def slot(self) -> str:
        return naming.slot_name(self.identifier)

    @property
    def publication(self) -> str:
        return naming.publication_name(self.identifier)

    def table(self, name: str) -> sql.Identifier:
        return sql.Identifier(self.schema, name)

    def qualified(self, name: str) -> str:
        return f"{self.schema}.{name}"

    def sql(self, query: str, params: Any = None, dsn: str | None = None) -> list[tuple[Any, ...]]:
        """Runs `query` with `{schema}` replaced by the quoted schema name."""
        text = query.replace("{schema}", sql.Identifier(self.schema).as_string(None))
        return execute(dsn or self.dsn, text, params)  # type: ignore[arg-type]

    def table_schema(self, name: str) -> TableSchema:
        """The table as the snapshot path reads it from the catalog."""
        with source.connect(self.dsn) as connection:
            return source.table_schema(connection, TableConfig(name=self.qualified(name)))

    def rows_as_text(self, table: TableSchema) -> list[tuple[str | None, ...]]:
        """Every row as the server prints its values (as pgoutput and COPY send them), ordered by key
        like `Target.current_rows_as_text`."""
        return rows_as_text(self.dsn, table)

    def config(self, tables: list[str | dict[str, Any]], dsn: str | None = None, **producer: Any) -> dict[str, Any]:
        qualified = [self.qualified(t) if isinstance(t, str) else {**t, "name": self.qualified(t["name"])}
                     for t in tables]
        return producer_config(self.identifier, dsn or self.dsn, self.nats_url, qualified, **producer)

    def producer(self, tables: list[str | dict[str, Any]], start: bool = True, name: str = "producer",
                 queue: dict[str, Any] | None = None, dsn: str | None = None, **producer: Any) -> ProducerProcess:
        config = self.config(tables, dsn=dsn, **producer)
        if queue:
            config["queue"].update(queue)
        process = ProducerProcess(self.directory, config, name=f"{name}{len(self.producers)}")
        self.producers.append(process)
        return process.start() if start else process

    def events(self, table: str | None = None) -> list[stream.StreamEvent]:
        return stream.read_events(self.nats_url, self.identifier, self.qualified(table) if table else None)

    def wait_for_events(self, count: int, table: str | None = None, timeout: float = 30.0) -> list[stream.StreamEvent]:
        """Waits until the stream holds at least `count` distinct versions (of `table`)."""
        return stream.wait_for_events(
            self.nats_url, self.identifier, lambda events: len(stream.unique_events(events)) >= count, timeout,
            self.qualified(table) if table else None)

    def close(self, dsn: str | None = None) -> None:
        for process in self.producers:
            process.ensure_stopped()
        drop_application(dsn or self.dsn, self.nats_url, self.identifier)
        execute(self.dsn, sql.SQL("drop schema if exists {} cascade").format(sql.Identifier(self.schema)))


def rows_as_text(dsn: str, table: TableSchema) -> list[tuple[str | None, ...]]:
    """Every row of `table` at `dsn` as the server prints its values, ordered by key (see
    `Application.rows_as_text`)."""
    query = sql.SQL("select {} from {} order by {}").format(
        sql.SQL(", ").join(map(sql.Identifier, table.column_names)), sql.Identifier(table.schema, table.table),
        sql.SQL(", ").join(sql.Identifier(c.name) for c in table.key_columns))
    with source.connect(dsn) as connection, connection.cursor() as cursor:
        cursor.execute(query)
        result = cursor.pgresult
        assert result is not None
        values = [[result.get_value(row, column) for column in range(result.nfields)]
                  for row in range(result.ntuples)]
    return [tuple(None if value is None else bytes(value).decode() for value in row) for row in values]
