"""The demo's Dagster home gets the project's instance settings with its own snapshot pool limit and
its own cap on the snapshot sensor's load runs."""

from pathlib import Path

import yaml

from demo.run import (
    DEMO_SENSOR_LOAD_RUNS,
    DEMO_SNAPSHOT_RUNS_PER_TARGET,
    ROOT,
    SENSOR_LOAD_TAG,
    write_instance_config,
)
from siphon_dagster.snapshot_sensor import SENSOR_LOAD_TAG as TAG_ON_LOAD_RUNS


def test_demo_instance_config_differs_from_the_project_only_in_its_snapshot_limits(tmp_path: Path) -> None:
    written = tmp_path / "dagster.yaml"
    write_instance_config(written)
    project = yaml.safe_load((ROOT / "dagster.yaml").read_text())
    demo = yaml.safe_load(written.read_text())

    pools, project_pools = demo["concurrency"]["pools"], project["concurrency"]["pools"]
    assert pools["default_limit"] == DEMO_SNAPSHOT_RUNS_PER_TARGET != project_pools["default_limit"]
    demo["concurrency"]["pools"] = project_pools

    assert SENSOR_LOAD_TAG == TAG_ON_LOAD_RUNS
    limits, project_limits = (config["concurrency"]["runs"]["tag_concurrency_limits"] for config in (demo, project))
    assert limits == [{"key": TAG_ON_LOAD_RUNS, "limit": DEMO_SENSOR_LOAD_RUNS}]
    assert [limit["limit"] for limit in project_limits] != [DEMO_SENSOR_LOAD_RUNS]
    demo["concurrency"]["runs"]["tag_concurrency_limits"] = project_limits
    assert demo == project
