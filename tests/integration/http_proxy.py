"""A proxy on loopback in front of the embedded ClickHouse server, for tests of what a transport
can do to a request: each client connection gets a connection of its own to the server, whose
answers are piped back as they come, while a subclass decides what of the request goes on."""

from __future__ import annotations

import socket
import threading

from siphon_core.config import parse_config
from siphon_dagster.targets import build_target
from siphon_dagster.targets.clickhouse import ClickHouseTarget


class Proxy:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.listener.close()

    def forward(self, client: socket.socket, server: socket.socket) -> None:
        """Reads the client's requests and sends on what the server is to see."""
        raise NotImplementedError

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        server = socket.create_connection(self.upstream)
        threading.Thread(target=_pipe, args=(server, client), daemon=True).start()
        with client, server:
            self.forward(client, server)


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while piece := source.recv(1 << 20):
            sink.sendall(piece)
    except OSError:
        pass


def clickhouse_target_via(proxy: Proxy, database: str) -> ClickHouseTarget:
    """A ClickHouse target, as siphon.yaml builds it, that reaches the server through `proxy`."""
    config = parse_config({
        "application_identifier": "test", "source": {"dsn": "postgresql://x@127.0.0.1/x"},
        "tables": [{"name": "public.t"}],
        "targets": {"clickhouse": {"url": f"http://127.0.0.1:{proxy.port}", "database": database}},
    })
    target = build_target("clickhouse", config)
    assert isinstance(target, ClickHouseTarget)
    return target
