"""The code location's own reload request: the code server's address from its command line, one
request at a time, and what the sensor logs when the location cannot reload itself."""

from __future__ import annotations

import threading

from siphon_dagster.location_reload import (
    REQUEST_AGAIN_AFTER_SECONDS,
    CodeServerAddress,
    LocationReloader,
    parse_code_server_command,
)


def test_the_address_of_dagster_code_server_start_is_read_from_its_command_line():
    python = "/opt/venv/bin/python"
    assert parse_code_server_command([python, "-m", "dagster", "code-server", "start", "-m", "siphon_dagster",
                                      "--socket", "/tmp/x/sock", "--location-name", "siphon_dagster"]) \
        == CodeServerAddress(socket="/tmp/x/sock")
    # The deployment's image: every interface, reached here on the loopback.
    assert parse_code_server_command(["dagster", "code-server", "start", "-m", "siphon_dagster", "-h", "0.0.0.0",
                                      "-p", "4000"]) == CodeServerAddress(host="127.0.0.1", port=4000)
    assert parse_code_server_command(["dagster", "code-server", "start", "--port=4100", "--host=code.internal"]) \
        == CodeServerAddress(host="code.internal", port=4100)
    assert parse_code_server_command(["dagster", "code-server", "start", "-p", "4000"]) \
        == CodeServerAddress(host="localhost", port=4000)


def test_other_commands_are_no_code_server_that_can_reload():
    assert parse_code_server_command([]) is None
    assert parse_code_server_command(["dagster", "api", "grpc", "-p", "4000"]) is None
    assert parse_code_server_command(["dagster", "dev", "-m", "siphon_dagster"]) is None
    assert parse_code_server_command(["dagster", "code-server", "start"]) is None  # no address to reach
    assert parse_code_server_command(["dagster", "code-server", "start", "-p"]) is None


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_reload_is_requested_once_and_again_only_after_a_long_wait():
    calls: list[CodeServerAddress] = []
    done = threading.Event()
    address = CodeServerAddress(socket="/tmp/s")

    def reload(at: CodeServerAddress) -> None:
        calls.append(at)
        done.set()

    clock = _Clock()
    reloader = LocationReloader(find_server=lambda: address, reload=reload, clock=clock, delay_seconds=0)
    said = reloader.request("tables added: public.c")
    assert "reloading the code location (code server at socket /tmp/s)" in said
    assert done.wait(10)
    reloader.thread.join(10)
    clock.now += 30  # the next tick, while the new definitions load
    assert "requested 30s ago" in reloader.request("tables added: public.c")
    assert calls == [address]
    clock.now += REQUEST_AGAIN_AFTER_SECONDS  # the new definitions never took over: ask again
    done.clear()
    reloader.request("tables added: public.c")
    assert done.wait(10)
    assert calls == [address, address]


def test_a_failed_reload_is_logged_and_does_not_raise_into_the_sensor():
    def reload(_: CodeServerAddress) -> None:
        raise ConnectionError("code server unreachable")

    reloader = LocationReloader(find_server=lambda: CodeServerAddress(port=1), reload=reload, delay_seconds=0)
    reloader.request("tables removed: public.b")
    reloader.thread.join(10)
    assert reloader.last_error == "code server unreachable"


def test_without_a_code_server_the_request_says_what_the_operator_must_do():
    reloader = LocationReloader(find_server=lambda: None, reload=lambda _: None)
    said = reloader.request("tables added: public.c")
    assert "not served by `dagster code-server start`" in said and "reload or restart it" in said
    assert reloader.thread is None
