"""The Spark properties dagster-pyspark builds a run's session from: a capped local driver, or a
Spark Connect client; no Spark starts here."""

from __future__ import annotations

import pytest

from siphon_core.config import SparkConfig
from siphon_dagster.streaming.spark_session import REMOTE_ENVIRONMENT_VARIABLE, spark_properties


@pytest.fixture(autouse=True)
def no_remote_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REMOTE_ENVIRONMENT_VARIABLE, raising=False)


def test_a_local_driver_gets_a_task_slot_and_a_shuffle_partition_per_core():
    properties = spark_properties(SparkConfig(master="local[3]"))

    assert properties["spark.master"] == "local[3]"
    assert properties["spark.sql.shuffle.partitions"] == properties["spark.default.parallelism"] == "3"
    assert properties["spark.ui.enabled"] == "false" and properties["spark.driver.host"] == "127.0.0.1"
    assert "spark.remote" not in properties


def test_max_python_workers_caps_the_local_task_slots():
    properties = spark_properties(SparkConfig(master="local[4]", max_python_workers=1))

    assert properties["spark.master"] == "local[1]"
    assert properties["spark.sql.shuffle.partitions"] == "1"


def test_a_remote_url_makes_a_connect_client_with_runtime_settings_only():
    properties = spark_properties(SparkConfig(remote="sc://spark.internal:15002",
                                              conf={"spark.sql.session.timeZone": "UTC"}))

    assert properties == {"spark.remote": "sc://spark.internal:15002",
                          "spark.sql.execution.arrow.pyspark.enabled": "true",
                          "spark.sql.session.timeZone": "UTC"}


def test_the_environment_variable_makes_a_connect_client_too(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(REMOTE_ENVIRONMENT_VARIABLE, "sc://127.0.0.1:15002")

    assert spark_properties(SparkConfig())["spark.remote"] == "sc://127.0.0.1:15002"


def test_configured_properties_win_over_the_defaults():
    properties = spark_properties(SparkConfig(conf={"spark.driver.memory": "4g", "spark.ui.enabled": "true"}))

    assert properties["spark.driver.memory"] == "4g" and properties["spark.ui.enabled"] == "true"


def test_a_remote_that_is_not_a_spark_connect_url_is_refused():
    with pytest.raises(ValueError, match=r"spark.remote must be a Spark Connect URL like sc://host:15002, "
                                         r"got 'spark://master:7077'"):
        spark_properties(SparkConfig(remote="spark://master:7077"))
