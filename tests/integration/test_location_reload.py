"""The code location reloads itself: a real `dagster code-server start` serves siphon_dagster, a
table is added to siphon.yaml, and a streaming sensor tick sent through the code server (as the
daemon sends it) has the server load the definitions again, with the new table's jobs."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster._core.remote_origin import GrpcServerCodeLocationOrigin
from dagster._core.remote_representation.code_location import GrpcServerCodeLocation

from siphon_core.config import CONFIG_VARIABLE
from siphon_dagster.location_reload import CodeServerAddress, serving_code_server
from siphon_stack.process import start_process, stop_pid, wait_until
from tests.helpers.instance import instance_for_test
from tests.integration.test_sensors import config, raw_config  # noqa: F401 - the fixture, and the file it loads

LOCATION = "siphon_dagster"


@pytest.fixture
def short_directory():
    """A Unix socket's path must be short (108 bytes): pytest's temporary paths can be longer."""
    directory = tempfile.mkdtemp(prefix="siphon-cs-")
    yield Path(directory)
    shutil.rmtree(directory, ignore_errors=True)


def _server_id(origin: GrpcServerCodeLocationOrigin) -> str | None:
    try:
        return origin.create_client().get_server_id(timeout=5)
    except Exception:
        return None


def _asset_keys(origin: GrpcServerCodeLocationOrigin, instance: dg.DagsterInstance) -> set[str]:
    """The asset keys the UI and the daemon see in the location."""
    location = GrpcServerCodeLocation(origin, instance=instance, watch_server=False)
    try:
        return {node.asset_key.to_user_string() for repository in location.get_repositories().values()
                for node in repository.get_asset_node_snaps()}
    finally:
        location.cleanup()


def test_a_table_added_to_siphon_yaml_is_served_after_the_sensor_reloads_the_code_location(
        config, tmp_path, short_directory, postgres_dsn, nats_url, unique_name):  # noqa: F811
    path = tmp_path / "siphon.yaml"
    raw = raw_config(postgres_dsn, nats_url, unique_name)
    path.write_text(yaml.safe_dump(raw))
    home = tmp_path / "dagster_home"
    home.mkdir()
    socket = str(short_directory / "code.sock")
    env = {**os.environ, CONFIG_VARIABLE: str(path), "DAGSTER_HOME": str(home)}
    server = start_process("code server", [str(Path(sys.executable).parent / "dagster"), "code-server", "start",
                                           "-m", "siphon_dagster", "--socket", socket, "--location-name", LOCATION],
                           tmp_path / "code-server.log", env=env, cwd=tmp_path)
    origin = GrpcServerCodeLocationOrigin(host="localhost", socket=socket, location_name=LOCATION)
    try:
        wait_until("the code server", lambda: _server_id(origin) is not None, 120)
        # What the location's own process finds as its parent: this server, at this socket.
        assert serving_code_server(parent_pid=server.pid) == CodeServerAddress(socket=socket)
        first_id = _server_id(origin)
        schema = unique_name
        newcomer, grows = f"clickhouse/{schema}/newcomer", f"clickhouse/{schema}/grows"
        with instance_for_test(temp_dir=str(home)) as instance:
            assert grows in _asset_keys(origin, instance)
            assert newcomer not in _asset_keys(origin, instance)

            raw["tables"].append({"name": f"{schema}.newcomer"})
            path.write_text(yaml.safe_dump(raw))
            location = GrpcServerCodeLocation(origin, instance=instance, watch_server=False)
            try:
                repository = next(iter(location.get_repositories().values()))
                sensor_name = next(s.name for s in repository.get_sensors() if s.name.endswith("_streaming"))
                tick = location.get_sensor_execution_data(instance, repository.handle, sensor_name, None, None, None,
                                                          None, None)
            finally:
                location.cleanup()
            said = tick.cursor and yaml.safe_load(tick.cursor)["siphon.yaml"]
            assert f"tables added: {schema}.newcomer" in said and "reloading the code location" in said

            # The server loads the file again by itself: a new server id, and the new table's assets.
            wait_until("the reloaded definitions", lambda: _server_id(origin) not in (None, first_id), 240)
            assert newcomer in _asset_keys(origin, instance)
            assert grows in _asset_keys(origin, instance)
    finally:
        stop_pid(server.pid)
