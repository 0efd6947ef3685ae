"""Resync job names, connection-failure classification, wait reports, partition selection and
tombstone batches: the parts of resync, repair and resilient snapshots that need no server."""

import pytest

from siphon_core import naming
from siphon_core.config import ConfigError, parse_config
from siphon_core.replication import ReplicationError
from siphon_dagster import runs
from siphon_dagster.checks.digest import DIFFERS, EXTRA, MISSING, DivergentKey, ParityReport
from siphon_dagster.definitions import build_definitions
from siphon_dagster.parity_repair import ParityRepair
from siphon_dagster.repair import _tombstones
from siphon_dagster.snapshot.blockers import BlockingBackend, SnapshotWaitLimitError, WaitReport
from siphon_dagster.snapshot.load import is_connection_failure
from siphon_dagster.targets.base import SourceColumn, TableSchema, TargetError, change_batch_schema
from tests.helpers.instance import instance_for_test
from tests.unit.test_definitions import config


@pytest.mark.parametrize(("schema", "table", "job"), [
    ("public", "notes", "resync_notes"),
    ("audit", "events", "resync_audit__events"),
    ("public", 'we"ird t.able', "resync_we_ird_t_able"),
])
def test_resync_jobs_are_named_as_streaming_jobs_are(schema, table, job):
    assert naming.resync_job_name(schema, table) == job


def test_every_table_has_a_resync_job_tagged_as_one():
    defs = build_definitions(config())
    jobs = {job.name: job for job in defs.resolve_all_job_defs()}
    assert {"resync_audit__events", "resync_Sales__OrderLines", "resync_we_ird", "resync_with_space"} <= set(jobs)
    assert jobs["resync_audit__events"].tags["siphon/resync"] == "audit.events"


def test_the_wait_limit_is_a_source_setting_refused_when_negative():
    raw = {"application_identifier": "a", "source": {"dsn": "postgresql://x@h/d"}, "tables": [{"name": "public.t"}]}
    assert parse_config(raw).source.snapshot_wait_limit_seconds == 1800
    with pytest.raises(ConfigError, match=r"source.snapshot_wait_limit_seconds: Input should be greater"):
        parse_config({**raw, "source": {"dsn": "postgresql://x@h/d", "snapshot_wait_limit_seconds": -1}})


def _raised_from(cause: BaseException, outer: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as error:
            raise outer from error
    except BaseException as raised:
        return raised


def test_only_connection_failures_are_retried():
    import psycopg

    assert is_connection_failure(psycopg.OperationalError("server closed the connection unexpectedly"))
    assert is_connection_failure(ConnectionRefusedError(111, "refused"))
    assert is_connection_failure(ReplicationError("cannot open a replication connection to x: refused"))
    assert is_connection_failure(ReplicationError("terminated", sqlstate="57P01"))
    # A target's error that a lost connection caused, however deep.
    assert is_connection_failure(_raised_from(ConnectionResetError(104, "reset"), TargetError("load failed")))
    assert not is_connection_failure(ReplicationError("syntax error", sqlstate="42601"))
    assert not is_connection_failure(TargetError("column x cannot be converted"))
    assert not is_connection_failure(ValueError("bad partition key"))
    report = WaitReport("public.notes", 10.0, ())
    assert not is_connection_failure(_raised_from(ConnectionResetError(), SnapshotWaitLimitError(report)))


def test_a_wait_report_names_each_blocking_backend():
    blocker = BlockingBackend(4242, 3600.0, "idle in transaction", "2026-11-25 04:00:00+00", "app", "psql")
    report = WaitReport("public.notes", 31.0, (blocker,), limit_seconds=1800)
    text = report.text()
    assert "public.notes" in text and "pid 4242" in text and "idle in transaction" in text
    assert "snapshot_wait_limit_seconds" in text and "pg_terminate_backend" in text
    assert report.metadata()["blocking_pids"] == [4242]
    assert "no backend" in WaitReport("public.notes", 6.0, ()).text()


def test_partition_selections_are_checked_against_the_instance():
    spec = runs.find_spec(config(), "audit.events")
    with instance_for_test() as instance:
        with pytest.raises(runs.SelectionError, match="no partitions yet"):
            runs.partition_spans(instance, spec, "all")
        keys = ["00000000-00000127", "00000128-00000255", "00000256-00000383", "00000384-00000511"]
        instance.add_dynamic_partitions(spec.partitions_def_name, keys)
        assert runs.partition_spans(instance, spec, "all") == [(keys[0], keys[-1])]
        assert runs.partition_spans(instance, spec, keys[1]) == [(keys[1], keys[1])]
        assert runs.partition_spans(instance, spec, f"{keys[1]}...{keys[2]}") == [(keys[1], keys[2])]
        for bad, said in (("junk", "not a block range"), ("00000000-00000099", "blocks_per_partition=128"),
                          ("00000512-00000639", "has no partition"), (f"{keys[2]}...{keys[1]}", "ends before")):
            with pytest.raises(runs.SelectionError, match=said):
                runs.partition_spans(instance, spec, bad)
        assert runs.contiguous_spans(instance, spec, [keys[3], keys[0], keys[1]]) == [(keys[0], keys[1]),
                                                                                      (keys[3], keys[3])]


def test_unknown_tables_and_targets_are_named_with_what_is_configured():
    with pytest.raises(runs.SelectionError, match=r"'public.nope' is not in the configuration.*'audit.events'"):
        runs.find_spec(config(), "public.nope")
    spec = runs.find_spec(config(snowflake=False), "audit.events")
    with pytest.raises(runs.SelectionError, match="its targets are: clickhouse"):
        runs.choose_targets(spec, "snowflake")


def test_tombstones_carry_the_key_and_nothing_else():
    table = TableSchema("public", "pairs", (
        SourceColumn("left", 23, "integer", nullable=False, primary_key=True),
        SourceColumn("body", 25, "text", nullable=False),
        SourceColumn("right", 25, "text", nullable=False, primary_key=True),
    ))
    batch = _tombstones(table, [("1", "a"), ("2", "b")], naming.row_version(0x10, 0))
    assert batch.schema == change_batch_schema(table)
    assert batch.to_pydict() == {"left": ["1", "2"], "body": [None, None], "right": ["a", "b"],
                                 "_siphon_version": [naming.row_version(0x10, 0)] * 2,
                                 "_siphon_deleted": [True, True]}


def test_a_parity_repair_reports_what_row_parity_found_and_what_ran():
    report = ParityReport(source_rows=1500, target_rows=1501, digits=1, buckets=16, mismatched_buckets=3,
                          divergent=[DivergentKey(("3",), MISSING, "00000000-00000015"),
                                     DivergentKey(("5",), DIFFERS, "00000000-00000015"),
                                     DivergentKey(("900001",), EXTRA, None)],
                          in_flight=[("77",)])
    repair = ParityRepair("public.items", "clickhouse", report, report.partitions,
                          [runs.RunOutcome("r1", True, "00000000-00000015", "00000000-00000015")])
    assert repair.partitions == ["00000000-00000015"] and repair.success
    assert repair.lines() == [
        "public.items at clickhouse: row parity found 3 divergent keys (1 extra at target, 1 missing at target, "
        "1 values differ) in 3 of 16 buckets; 1 keys still changing, left to the stream",
        "public.items at clickhouse, partitions 00000000-00000015...00000000-00000015: re-snapshotted (run r1)",
    ]
    failed = ParityRepair("public.items", "clickhouse", report, report.partitions,
                          [runs.RunOutcome("r2", False, "00000000-00000015", "00000000-00000015")])
    assert not failed.success and "FAILED (run r2)" in failed.lines()[1]
    clean = ParityRepair("public.items", "clickhouse", ParityReport(source_rows=10, buckets=1))
    assert clean.success and clean.lines()[-1] == "public.items at clickhouse: nothing to repair"


def test_a_resync_whose_checks_did_not_all_report_fails(monkeypatch):
    """The checks that end a resync prove it only if each reported: one whose run failed before it
    evaluated counts as failed, as `siphon-dagster check` counts it."""
    import dagster as dg

    from siphon_dagster.checks import command
    from siphon_dagster.checks.definitions import check_keys
    from siphon_dagster.definitions import _checks_after_resync
    from siphon_dagster.specs import group_name, table_specs
    from tests.helpers.instance import instance_for_test

    config = parse_config({"application_identifier": "chk", "source": {"dsn": "postgresql://x@127.0.0.1:1/db"},
                           "tables": [{"name": "public.notes"}],
                           "targets": {"clickhouse": {"url": "http://127.0.0.1:1"}}})
    spec = table_specs(config)[0]
    keys = check_keys(spec, "clickhouse")
    first = keys[0]
    # Only the first check reported (and passed); the others' run ended before them.
    monkeypatch.setattr(command, "run_checks", lambda *args, **kwargs: [dg.AssetCheckEvaluation(
        asset_key=first.asset_key, check_name=first.name, passed=True)])
    run = _checks_after_resync([build_definitions(config)], group_name(config.application_identifier))
    with instance_for_test() as instance:
        failed = run(dg.build_op_context(instance=instance), spec, ["clickhouse"])
    assert [line.split()[2] for line in failed] == [key.name for key in keys[1:]]
    assert all("did not run" in line for line in failed)
