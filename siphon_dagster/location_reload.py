"""The code location reloads itself when siphon.yaml's tables change.

Dagster builds a code location's assets, jobs and sensors once, when it loads the code, and
`dagster code-server start` (what `dagster dev` runs, and the deployment's image) loads them in a
child process that it replaces on request: its ReloadCode call, which the UI's Reload sends. A new
child loads the file as it is now, the webserver and the daemon see the server's new id and take
its definitions, and the old child ends once the runs it launched have ended (the streaming sensor
replaces those whose tables changed). This module makes that request from inside the child, so a
table added to or removed from siphon.yaml is served without an operator's reload.

A code location served by `dagster api grpc` alone cannot reload without a restart of its process:
there the sensor keeps saying what to do.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from siphon_core.logs import get_logger

_log = get_logger("dagster.location_reload")
# How long the code server may take to load the definitions again (hundreds of tables take a minute).
RELOAD_TIMEOUT_SECONDS = 600
# A reload requested is not requested again this soon: while the new child loads, the old one's
# sensor still sees the file differ from what it loaded.
REQUEST_AGAIN_AFTER_SECONDS = 900.0
# The request waits this long, so that the sensor tick that asked for it returns first.
REQUEST_DELAY_SECONDS = 2.0


@dataclass(frozen=True)
class CodeServerAddress:
    """Where a `dagster code-server start` process listens: a Unix socket, or a host and port."""

    socket: str | None = None
    host: str = "localhost"
    port: int | None = None

    def describe(self) -> str:
        return f"socket {self.socket}" if self.socket else f"{self.host}:{self.port}"


def parse_code_server_command(argv: Sequence[str]) -> CodeServerAddress | None:
    """The address of `dagster code-server start` from its command line; None for any other command."""
    words = list(argv)
    try:
        at = words.index("code-server")
    except ValueError:
        return None
    if words[at + 1:at + 2] != ["start"]:
        return None
    options: dict[str, str] = {}
    rest = words[at + 2:]
    for i, word in enumerate(rest):
        name, equals, value = word.partition("=")
        if name in ("--socket", "-s", "--port", "-p", "--host", "-h"):
            if not equals:
                value = rest[i + 1] if i + 1 < len(rest) else ""
            options[name.lstrip("-")[0]] = value
    if options.get("s"):
        return CodeServerAddress(socket=options["s"])
    if not options.get("p", "").isdigit():
        return None
    host = options.get("h") or "localhost"
    # A server listening on every interface is reached on this machine's loopback.
    return CodeServerAddress(host="127.0.0.1" if host in ("0.0.0.0", "::", "[::]") else host, port=int(options["p"]))


def serving_code_server(parent_pid: int | None = None) -> CodeServerAddress | None:
    """The `dagster code-server start` process that started this one, if that is what did."""
    pid = os.getppid() if parent_pid is None else parent_pid
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # not Linux, or the parent is gone
        return None
    return parse_code_server_command([part.decode(errors="replace") for part in raw.split(b"\0") if part])


def _reload(address: CodeServerAddress) -> None:
    from dagster._grpc.client import DagsterGrpcClient

    client = DagsterGrpcClient(port=address.port, socket=address.socket, host=address.host)
    client.reload_code(timeout=RELOAD_TIMEOUT_SECONDS)


class LocationReloader:
    """Asks the code server serving this process to load the code location again, at most once per
    `REQUEST_AGAIN_AFTER_SECONDS`, on a thread of its own (the call returns once the new definitions
    are loaded, up to minutes)."""

    def __init__(self, find_server: Callable[[], CodeServerAddress | None] = serving_code_server,
                 reload: Callable[[CodeServerAddress], None] = _reload,
                 clock: Callable[[], float] = time.monotonic, delay_seconds: float = REQUEST_DELAY_SECONDS) -> None:
        self._find_server = find_server
        self._reload = reload
        self._clock = clock
        self._delay_seconds = delay_seconds
        self._requested_at: float | None = None
        self._lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.last_error: str | None = None  # how the last request failed, if it did

    def request(self, reason: str) -> str:
        """Requests a reload for `reason` (unless one was requested lately); what happens, to log."""
        address = self._find_server()
        if address is None:
            return ("this code location is not served by `dagster code-server start`, which alone can load it again "
                    "by itself: reload or restart it")
        with self._lock:
            now = self._clock()
            if self._requested_at is not None and now - self._requested_at < REQUEST_AGAIN_AFTER_SECONDS:
                return (f"the code location's reload was requested {now - self._requested_at:.0f}s ago; the new "
                        "definitions take over once loaded")
            self._requested_at = now
        self.thread = threading.Thread(target=self._run, args=(address, reason), name="siphon-location-reload",
                                       daemon=True)
        self.thread.start()
        return f"reloading the code location (code server at {address.describe()}) to serve it"

    def _run(self, address: CodeServerAddress, reason: str) -> None:
        time.sleep(self._delay_seconds)
        _log.info("reloading the code location", reason=reason, code_server=address.describe())
        try:
            self._reload(address)
            self.last_error = None
        except Exception as error:  # asked again by a sensor tick after REQUEST_AGAIN_AFTER_SECONDS
            self.last_error = " ".join(str(error).split())[:500]
            _log.warning("reloading the code location failed", code_server=address.describe(), error=self.last_error)
