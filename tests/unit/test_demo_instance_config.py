"""The demo's Dagster home gets the project's instance settings with its own snapshot pool limit."""

from pathlib import Path

import yaml

from demo.run import DEMO_SNAPSHOT_RUNS_PER_TARGET, ROOT, write_instance_config


def test_demo_instance_config_differs_from_the_project_only_in_the_snapshot_pools(tmp_path: Path) -> None:
    written = tmp_path / "dagster.yaml"
    write_instance_config(written)
    project = yaml.safe_load((ROOT / "dagster.yaml").read_text())
    demo = yaml.safe_load(written.read_text())

    pools, project_pools = demo["concurrency"]["pools"], project["concurrency"]["pools"]
    assert pools["default_limit"] == DEMO_SNAPSHOT_RUNS_PER_TARGET != project_pools["default_limit"]
    demo["concurrency"]["pools"] = project_pools
    assert demo == project
