"""Prometheus metrics and the /healthz endpoint of the producer."""

from __future__ import annotations

import json
import resource
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

_TIMING_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


# Index = siphon.v1.Operation value.
OPERATION_NAMES = ("unspecified", "insert", "update", "delete", "truncate", "snapshot")


class EventCounts(Collector):
    """`siphon_producer_events_total`: plain integers the hot path increments (a labelled
    Prometheus counter costs about a microsecond per event), read when /metrics is scraped."""

    def __init__(self) -> None:
        self._tables: dict[str, list[int]] = {}

    def for_table(self, table: str) -> list[int]:
        """The table's counts, indexed by operation; only the producer's loop increments them."""
        return self._tables.setdefault(table, [0] * len(OPERATION_NAMES))

    def collect(self):  # type: ignore[no-untyped-def]
        family = CounterMetricFamily("siphon_producer_events", "Change events packaged, by table and operation",
                                     labels=["table", "operation"])
        for table, counts in list(self._tables.items()):
            for operation, name in enumerate(OPERATION_NAMES):
                if counts[operation] or name in ("insert", "update", "delete"):
                    family.add_metric([table, name], counts[operation])
        yield family


class ProducerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.events = EventCounts()
        r.register(self.events)
        self.packages = Counter("siphon_producer_packages_total", "Packages published and acknowledged",
                                ["table"], registry=r)
        self.package_bytes = Counter("siphon_producer_package_bytes_total", "Compressed bytes published",
                                     ["table"], registry=r)
        self.decode_seconds = Histogram("siphon_producer_decode_seconds", "Time to decode a batch of WAL messages",
                                        buckets=_TIMING_BUCKETS, registry=r)
        self.serialize_seconds = Histogram("siphon_producer_serialize_seconds",
                                           "Time to compress one package", buckets=_TIMING_BUCKETS,
                                           registry=r)
        self.publish_seconds = Histogram("siphon_producer_publish_ack_seconds",
                                         "Time from publish to the stream's ack", buckets=_TIMING_BUCKETS, registry=r)
        self.buffered_events = Gauge("siphon_producer_buffered_events", "Events waiting in table buffers",
                                     registry=r)
        self.buffered_bytes = Gauge("siphon_producer_buffered_bytes", "Bytes waiting in table buffers", registry=r)
        self.in_flight_packages = Gauge("siphon_producer_in_flight_packages", "Packages published, not yet acked",
                                        registry=r)
        self.resident_memory = Gauge("siphon_producer_max_resident_memory_bytes", "Peak resident memory",
                                     registry=r)
        self.slot_lag_bytes = Gauge("siphon_producer_slot_lag_bytes",
                                    "Server WAL end minus the LSN confirmed to PostgreSQL", registry=r)
        self.acked_lsn = Gauge("siphon_producer_last_acked_lsn", "Last LSN confirmed to PostgreSQL", registry=r)
        self.received_lsn = Gauge("siphon_producer_last_received_lsn", "Last WAL position received", registry=r)
        self.configured_tables = Gauge("siphon_producer_configured_tables",
                                       "Tables in the publication, as siphon.yaml lists them", registry=r)
        self.reconnects = Counter("siphon_producer_reconnects_total", "Reconnections to PostgreSQL", registry=r)
        self.slot_gaps = Counter("siphon_producer_slot_gaps_total",
                                 "Lost replication slots recorded as gaps on the queue, by reason", ["reason"],
                                 registry=r)
        self.heartbeats = Counter("siphon_producer_heartbeats_total", "Heartbeat messages emitted", registry=r)
        self.started_at = time.time()
        self.healthy = False
        self.health_detail: dict[str, object] = {"state": "starting"}

    def sample_memory(self) -> None:
        # ru_maxrss is in KiB on Linux.
        self.resident_memory.set(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


class EndpointError(RuntimeError):
    """The /metrics and /healthz endpoint cannot listen where configured."""


class MetricsServer:
    """Serves /metrics and /healthz on a loopback port in a daemon thread."""

    def __init__(self, metrics: ProducerMetrics, host: str, port: int,
                 health: Callable[[], tuple[bool, dict[str, object]]]) -> None:
        registry = metrics.registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                if self.path.startswith("/metrics"):
                    metrics.sample_memory()
                    body, status, kind = generate_latest(registry), 200, CONTENT_TYPE_LATEST
                elif self.path.startswith("/healthz"):
                    ok, detail = health()
                    body, status, kind = json.dumps(detail).encode(), 200 if ok else 503, "application/json"
                else:
                    body, status, kind = b"not found\n", 404, "text/plain"
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                pass

        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as error:
            raise EndpointError(f"cannot serve /metrics and /healthz on {host}:{port} ({error.strerror}); "
                                "free the port or set producer.metrics_port (0 picks a free one)") from None
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
