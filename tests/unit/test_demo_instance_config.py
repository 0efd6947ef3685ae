"""The demo's Dagster home gets the project's instance settings with its own snapshot pool limit."""

from pathlib import Path

import yaml

from demo.run import DEMO_SNAPSHOT_RUNS_PER_TARGET, ROOT, write_instance_config


def test_demo_instance_config_differs_from_the_project_only_in_the_pool_limit(tmp_path: Path) -> None:
    written = tmp_path / "dagster.yaml"
    write_instance_config(written)
    project = yaml.safe_load((ROOT / "dagster.yaml").read_text())
    demo = yaml.safe_load(written.read_text())

    assert demo["concurrency"]["pools"]["default_limit"] == DEMO_SNAPSHOT_RUNS_PER_TARGET
    assert project["concurrency"]["pools"]["default_limit"] != DEMO_SNAPSHOT_RUNS_PER_TARGET
    demo["concurrency"]["pools"]["default_limit"] = project["concurrency"]["pools"]["default_limit"]
    assert demo == project
