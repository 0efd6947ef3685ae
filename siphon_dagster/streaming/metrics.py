"""Prometheus metrics of the Dagster side: streaming batches per (target, table) and asset checks.

A streaming run calls `record_batch` after each micro-batch and a check calls `record_check`; a
process serves them with `serve(port)` (`streaming.metrics_port` in siphon.yaml, 0: not served).
Each run is its own process (one Kubernetes pod per run), so every series also carries the pod
Prometheus scraped it from: alerts and dashboards aggregate with `max by (target, table)`.
"""

from __future__ import annotations

import os
import threading
import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)

from siphon_core.logs import get_logger
from siphon_dagster.streaming.report import BatchReport

_log = get_logger("streaming.metrics")
_TABLE = ["target", "table"]
# A batch takes from well under a second (a trickle) to a minute (a backlog through a slow target).
_BATCH_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class StreamingMetrics:
    """The series, in a registry of their own so that tests and the producer's registry never mix."""

    def __init__(self) -> None:
        # A `_created` series beside every counter and histogram of every table: a quarter of the
        # lines a run of 500 tables serves (1.5 MB, about a second of the run's CPU per scrape),
        # and nothing reads them. The setting is the process's: a run process serves only these.
        disable_created_metrics()
        self.registry = CollectorRegistry()
        r = self.registry
        self.applied_lsn = Gauge("siphon_stream_applied_lsn", "Greatest commit LSN applied to the target",
                                 _TABLE, registry=r)
        self.lag_seconds = Gauge("siphon_stream_lag_seconds",
                                 "Age of the newest change of the last batch when it was acknowledged",
                                 _TABLE, registry=r)
        self.pending_messages = Gauge("siphon_stream_pending_messages",
                                      "Messages of the table's consumer still to apply after the last batch",
                                      _TABLE, registry=r)
        self.last_batch = Gauge("siphon_stream_last_batch_timestamp_seconds",
                                "Unix time the last batch was acknowledged", _TABLE, registry=r)
        self.batches = Counter("siphon_stream_batches_total", "Micro-batches applied and acknowledged",
                               _TABLE, registry=r)
        self.rows = Counter("siphon_stream_rows_total", "Change events applied, by operation (before the fold)",
                            [*_TABLE, "operation"], registry=r)
        self.rows_applied = Counter("siphon_stream_rows_applied_total",
                                    "Rows written to the target after the fold", _TABLE, registry=r)
        self.dead_lettered = Counter("siphon_stream_dead_lettered_total",
                                     "Messages moved to the table's dead-letter subject", _TABLE, registry=r)
        self.batch_seconds = Histogram("siphon_stream_batch_seconds",
                                       "From a batch's first message pulled to its acknowledgement",
                                       _TABLE, buckets=_BATCH_BUCKETS, registry=r)
        # Per target, not per table: where the batches' time goes (pull, schema, decode, spark, merge,
        # toast, apply, ack), to tell a slow target from a slow decode without a series per table.
        self.phase_seconds = Counter("siphon_stream_batch_phase_seconds",
                                     "Seconds the target's batches spent in each phase of their apply",
                                     ["target", "phase"], registry=r)
        # Per target: how a group run's batches gathered (the pace's wait, in line for a turn, a
        # backlog, a table's first), to tell a run held by its pace from one at its capacity.
        self.batches_gathered = Counter("siphon_stream_batches_gathered_total",
                                        "A group run's batches by how they gathered their messages",
                                        ["target", "how"], registry=r)
        self.check_passed = Gauge("siphon_check_passed",
                                  "1 when the asset check's last evaluation passed, 0 when it failed",
                                  ["asset", "check", "severity"], registry=r)
        self.check_timestamp = Gauge("siphon_check_last_evaluation_timestamp_seconds",
                                     "Unix time of the asset check's last evaluation", ["asset", "check"],
                                     registry=r)
        self._check_severity: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()

    def record_batch(self, target: str, table: str, report: BatchReport) -> None:
        labels = (target, table)
        if report.applied_lsn:
            # A batch whose every message was dead-lettered applied nothing and has no commit time:
            # the position and the lag of the batch before still stand.
            self.applied_lsn.labels(*labels).set(report.applied_lsn)
            self.lag_seconds.labels(*labels).set(max(0.0, report.lag_newest_seconds))
        self.pending_messages.labels(*labels).set(report.pending)
        self.last_batch.labels(*labels).set(time.time())
        self.batches.labels(*labels).inc()
        for operation, count in report.rows_by_operation.items():
            if count:
                self.rows.labels(target, table, operation.lower()).inc(count)
        self.rows_applied.labels(*labels).inc(report.rows_applied)
        # Created at zero with the table's first batch, so `increase()` sees the first dead letter.
        self.dead_lettered.labels(*labels).inc(len(report.dead_lettered))
        self.batch_seconds.labels(*labels).observe(max(0.0, report.latency_seconds))
        for phase, seconds in report.seconds.items():
            self.phase_seconds.labels(target, phase).inc(max(0.0, seconds))
        if report.gathered is not None:
            self.batches_gathered.labels(target, report.gathered).inc()

    def record_check(self, asset: str, check: str, passed: bool, severity: str) -> None:
        severity = severity.lower()
        with self._lock:
            previous = self._check_severity.get((asset, check))
            if previous is not None and previous != severity:
                # One series per check: a check whose severity changed must not leave its old one behind.
                self.check_passed.remove(asset, check, previous)
            self._check_severity[(asset, check)] = severity
            self.check_passed.labels(asset, check, severity).set(1 if passed else 0)
            self.check_timestamp.labels(asset, check).set(time.time())


METRICS = StreamingMetrics()
# The port served, per process id: a forked step process inherits this dict but not the thread
# that serves, so it must serve its own.
_served: dict[int, int] = {}
_serve_lock = threading.Lock()


def record_batch(target: str, table: str, report: BatchReport) -> None:
    """Records one acknowledged micro-batch of `table` (schema.table) at `target`."""
    METRICS.record_batch(target, table, report)


def record_check(asset: str, check: str, passed: bool, severity: str) -> None:
    """Records an asset check's result; `asset` as the UI spells it (`clickhouse/public/notes`),
    `severity` as Dagster's (`ERROR`, `WARN`)."""
    METRICS.record_check(asset, check, passed, severity)


def serve(port: int, host: str = "127.0.0.1") -> int | None:
    """Serves /metrics on `port` once per process; returns the port, or None when not served.

    Call it in the process that records (the step process of a streaming run). Port 0 disables it.
    Several runs may share a machine (a local `dagster dev`), so a port already taken is logged and
    the run goes on without serving: metrics are never a reason to fail a run.
    """
    if port == 0:
        return None
    pid = os.getpid()
    with _serve_lock:
        if pid in _served:
            return _served[pid]
        try:
            server, _thread = start_http_server(port, addr=host, registry=METRICS.registry)
        except OSError as error:
            _log.warning("streaming metrics not served: the port is taken or not allowed; "
                         "set streaming.metrics_port to another port, or 0", host=host, port=port,
                         error=error.strerror or str(error))
            return None
        _served[pid] = server.server_address[1]
        _log.info("streaming metrics served", url=f"http://{host}:{_served[pid]}/metrics")
        return _served[pid]
