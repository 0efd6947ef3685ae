"""The streaming side's Prometheus series, read back from the registry and over HTTP."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import socket
import urllib.request

import pytest
from prometheus_client import generate_latest

from siphon_dagster.streaming import metrics
from siphon_dagster.streaming.report import BatchReport


def report(**changes: object) -> BatchReport:
    values: dict[str, object] = dict(
        target="clickhouse", table="public.notes", first_sequence=10, last_sequence=14, messages=5,
        events=1200, rows_by_operation={"insert": 1000, "update": 150, "delete": 50}, rows_applied=1100,
        applied_lsn=0x16B374D8, latency_seconds=0.8, lag_oldest_seconds=4.5, lag_newest_seconds=2.25,
        pending=42)
    values.update(changes)
    return BatchReport(**values)  # type: ignore[arg-type]


def sample(name: str, **labels: str) -> float | None:
    return metrics.METRICS.registry.get_sample_value(name, labels)


def test_a_batch_sets_position_lag_pending_and_counts_rows_by_operation() -> None:
    table = "public.batch_counts"
    metrics.record_batch("clickhouse", table, report(table=table))
    metrics.record_batch("clickhouse", table, report(table=table, applied_lsn=0x16B37500, pending=0,
                                                     rows_by_operation={"insert": 7, "truncate": 1},
                                                     lag_newest_seconds=0.5))
    where = {"target": "clickhouse", "table": table}
    assert sample("siphon_stream_applied_lsn", **where) == 0x16B37500
    assert sample("siphon_stream_lag_seconds", **where) == 0.5
    assert sample("siphon_stream_pending_messages", **where) == 0
    assert sample("siphon_stream_batches_total", **where) == 2
    assert sample("siphon_stream_rows_total", **where, operation="insert") == 1007
    assert sample("siphon_stream_rows_total", **where, operation="update") == 150
    assert sample("siphon_stream_rows_total", **where, operation="truncate") == 1
    assert sample("siphon_stream_rows_applied_total", **where) == 2200
    assert sample("siphon_stream_dead_lettered_total", **where) == 0  # present at zero for increase()
    assert sample("siphon_stream_batch_seconds_count", **where) == 2
    assert sample("siphon_stream_last_batch_timestamp_seconds", **where) > 1.7e9
    # Another target of the same table is a series of its own.
    assert sample("siphon_stream_batches_total", target="snowflake", table=table) is None


def test_a_group_runs_batches_are_counted_per_target_by_how_they_gathered() -> None:
    target = "gathered_target"
    for how in ("paced", "waiting_for_turn", "waiting_for_turn", None):
        metrics.record_batch(target, "public.gathered", report(target=target, table="public.gathered", gathered=how))
    assert sample("siphon_stream_batches_gathered_total", target=target, how="waiting_for_turn") == 2
    assert sample("siphon_stream_batches_gathered_total", target=target, how="paced") == 1
    # A by-hand run's batch (no group run's pace or turns) is not counted there.
    assert sample("siphon_stream_batches_total", target=target, table="public.gathered") == 4
    assert sample("siphon_stream_batches_gathered_total", target=target, how="backlog") is None


def test_a_table_serves_its_series_without_created_timestamps() -> None:
    # Hundreds of tables a run: every line counts, and the `_created` series were a quarter of them.
    table = "public.created_lines"
    metrics.record_batch("clickhouse", table, report(table=table))
    exposition = generate_latest(metrics.METRICS.registry).decode()
    lines = [line for line in exposition.splitlines() if f'table="{table}"' in line]
    assert lines and not [line for line in lines if "_created" in line]
    names = {line.split("{", 1)[0] for line in lines}
    assert {"siphon_stream_batches_total", "siphon_stream_batch_seconds_bucket",
            "siphon_stream_rows_total"} <= names


def test_a_batch_of_dead_letters_only_keeps_the_last_position_and_lag() -> None:
    table = "public.dead_letters"
    where = {"target": "snowflake", "table": table}
    metrics.record_batch("snowflake", table, report(table=table, lag_newest_seconds=3.0))
    metrics.record_batch("snowflake", table, report(table=table, applied_lsn=0, rows_by_operation={},
                                                    rows_applied=0, lag_newest_seconds=0.0,
                                                    dead_lettered=(15, 16, 17)))
    assert sample("siphon_stream_applied_lsn", **where) == 0x16B374D8
    assert sample("siphon_stream_lag_seconds", **where) == 3.0
    assert sample("siphon_stream_dead_lettered_total", **where) == 3


def test_a_check_keeps_one_series_when_its_severity_changes() -> None:
    metrics.record_check("clickhouse/public/notes", "row_count_matches", False, "WARN")
    assert sample("siphon_check_passed", asset="clickhouse/public/notes", check="row_count_matches",
                  severity="warn") == 0
    metrics.record_check("clickhouse/public/notes", "row_count_matches", True, "ERROR")
    assert sample("siphon_check_passed", asset="clickhouse/public/notes", check="row_count_matches",
                  severity="error") == 1
    assert sample("siphon_check_passed", asset="clickhouse/public/notes", check="row_count_matches",
                  severity="warn") is None
    assert sample("siphon_check_last_evaluation_timestamp_seconds", asset="clickhouse/public/notes",
                  check="row_count_matches") > 1.7e9


def test_serve_is_disabled_by_port_zero_and_goes_on_when_the_port_is_taken(
        caplog: pytest.LogCaptureFixture) -> None:
    assert metrics.serve(0) is None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level("WARNING"):
            assert metrics.serve(port) is None
    assert "streaming.metrics_port" in caplog.text


def test_serve_answers_with_the_series_once_per_process() -> None:
    metrics.record_batch("clickhouse", "public.served", report(table="public.served"))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    port = metrics.serve(free)
    assert port == free
    assert metrics.serve(free + 1) == free  # a second call keeps the one server
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'siphon_stream_batches_total{table="public.served",target="clickhouse"} 1.0' in body


def _serve_in_child(port: int, answer: multiprocessing.connection.Connection) -> None:
    metrics.record_batch("clickhouse", "public.forked", report(table="public.forked"))
    served = metrics.serve(port)
    body = urllib.request.urlopen(f"http://127.0.0.1:{served}/metrics", timeout=5).read().decode()
    answer.send((served, 'table="public.forked"' in body))


def test_a_forked_process_serves_its_own_series() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        parent_port = probe.getsockname()[1]
    metrics.serve(parent_port)  # served in this process already (or earlier by another test)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        child_port = probe.getsockname()[1]
    receiving, sending = multiprocessing.Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(target=_serve_in_child, args=(child_port, sending))
    child.start()
    assert receiving.poll(20), "the forked process did not answer"
    assert receiving.recv() == (child_port, True)
    child.join(10)
