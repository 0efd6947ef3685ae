"""`siphon-dagster`'s commands against real services."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from siphon_dagster import cli
from siphon_dagster.targets.base import SourceColumn, TableSchema
from tests.integration.test_targets_version_rule import make_target, target_settings


@pytest.mark.parametrize("target_name", ["clickhouse", "snowflake"])
def test_target_drop_removes_the_table_and_its_view_and_nothing_else(
        request: pytest.FixtureRequest, tmp_path: Path, unique_name: str, target_name: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    target = make_target(request, target_name, unique_name)
    columns = (SourceColumn("id", 23, "integer", -1, False, True, "N"), SourceColumn("body", 25, "text", -1, True, False, "S"))
    dropped, kept = TableSchema("public", "dropped", columns), TableSchema("public", "kept", columns)
    config = tmp_path / "siphon.yaml"
    try:
        for table in (dropped, kept):
            target.ensure_table(table)
        config.write_text(yaml.safe_dump({
            "application_identifier": unique_name, "source": {"dsn": "postgresql://unused@127.0.0.1/unused"},
            "tables": [{"name": "public.dropped"}, {"name": "public.kept"}],
            "targets": {target_name: target_settings(request, target_name, unique_name)},
        }))

        assert cli.main(["--config", str(config), "target", "drop", "--target", target_name,
                         "--table", "public.dropped"]) == 0

        assert f"materialize every partition of asset {target_name}/public/dropped" in capsys.readouterr().out
        assert target.describe_columns(dropped) == []
        assert [c.name for c in target.describe_columns(kept)][:2] == ["id", "body"]
        assert cli.main(["--config", str(config), "target", "drop", "--target", "elsewhere",
                         "--table", "public.dropped"]) == 2
        assert "target elsewhere is not configured" in capsys.readouterr().err
    finally:
        target.close()

