"""The MergeTree settings of the tables the ClickHouse target makes (`targets.clickhouse.table_settings`).

A server that refuses one of Siphon's defaults still gets its tables, without that setting and with
one warning. A setting siphon.yaml gives that the server refuses is an error naming it and the key
to change. Any other error of a statement that carries the settings is left as it is.
"""

from __future__ import annotations

import logging
from urllib.parse import urlparse

import clickhouse_connect
import pytest

from siphon_core.config import DEFAULT_CLICKHOUSE_TABLE_SETTINGS, parse_config
from siphon_dagster.targets import build_target
from siphon_dagster.targets.base import SourceColumn, TableSchema, TargetError
from siphon_dagster.targets.clickhouse import ClickHouseTarget
from tests.integration.test_targets_version_rule import NOTES, batch, row

UNKNOWN = "siphon_no_such_setting"  # a name no ClickHouse server knows: a refused setting
OTHER = TableSchema("public", "other", (SourceColumn("id", 20, "bigint", nullable=False, primary_key=True),))


def clickhouse_target(clickhouse_url: str, database: str, table_settings: dict | None = None) -> ClickHouseTarget:
    settings = {"url": clickhouse_url, "database": database}
    if table_settings is not None:
        settings["table_settings"] = table_settings
    config = parse_config({"application_identifier": "test", "source": {"dsn": "postgresql://x@127.0.0.1/x"},
                           "tables": [{"name": "public.notes"}], "targets": {"clickhouse": settings}})
    target = build_target("clickhouse", config)
    assert isinstance(target, ClickHouseTarget)
    return target


def table_settings_of(clickhouse_url: str, database: str, table: str) -> str:
    url = urlparse(clickhouse_url)
    client = clickhouse_connect.get_client(host=url.hostname, port=url.port)
    try:
        statement = client.query(f"SHOW CREATE TABLE `{database}`.`{table}`").result_rows[0][0]
    finally:
        client.close()
    return statement.rpartition("SETTINGS")[2]


def test_tables_are_made_with_the_default_settings(clickhouse_url: str, unique_name: str) -> None:
    target = clickhouse_target(clickhouse_url, unique_name)
    try:
        target.ensure_table(NOTES)
        target.create_shadow(NOTES)
        for table in ("public__notes", "public__notes__resync"):
            made = table_settings_of(clickhouse_url, unique_name, table)
            for name, value in DEFAULT_CLICKHOUSE_TABLE_SETTINGS.items():
                assert f"{name} = {value}" in made, (table, made)
    finally:
        target.close()


def test_a_default_setting_the_server_refuses_is_left_out_with_one_warning(
        clickhouse_url: str, unique_name: str, caplog: pytest.LogCaptureFixture) -> None:
    target = clickhouse_target(clickhouse_url, unique_name)
    # As an older server refuses a default it does not know yet.
    target.dialect.table_settings[UNKNOWN] = 1
    try:
        with caplog.at_level(logging.WARNING, logger="siphon.targets.clickhouse"):
            assert target.ensure_table(NOTES).created
            sibling = target.sibling()
            assert sibling.ensure_table(OTHER).created
            target.create_shadow(NOTES)
        warnings = [r.getMessage() for r in caplog.records if r.name == "siphon.targets.clickhouse"]
        assert len(warnings) == 1 and UNKNOWN in warnings[0] and "by default" in warnings[0], warnings
        made = table_settings_of(clickhouse_url, unique_name, "public__notes")
        assert UNKNOWN not in made and "min_bytes_for_full_part_storage = 16777216" in made, made
        target.apply_rows(NOTES, batch(NOTES, [row(1, "a", 1, 1)]))
        assert target.current_rows_as_text(NOTES) == [("1", "a", "1")]
        sibling.close()
    finally:
        target.close()


def test_a_setting_given_in_siphon_yaml_that_the_server_refuses_is_an_error(clickhouse_url: str, unique_name: str) -> None:
    target = clickhouse_target(clickhouse_url, unique_name, table_settings={UNKNOWN: 1})
    try:
        with pytest.raises(TargetError) as refused:
            target.ensure_table(NOTES)
        assert UNKNOWN in str(refused.value) and "targets.clickhouse.table_settings" in str(refused.value)
        assert "public.notes" in str(refused.value)
    finally:
        target.close()
