"""The pure logic of the checks: the count band, bucket sizes and diffs, key classification and
partitions, schema comparison, and the command's refusals of unknown tables and targets."""

import pytest

from siphon_core.config import ConfigError, parse_config
from siphon_dagster.checks.command import selected_keys
from siphon_dagster.checks.digest import (
    DIFFERS,
    EXTRA,
    MISSING,
    CountBand,
    DivergentKey,
    ExactCount,
    KeyRead,
    ParityReport,
    SourceRow,
    bucket_digits,
    classify,
    mismatched_buckets,
    partition_key,
    settle,
)
from siphon_dagster.checks.outcome import ERROR, WARN
from siphon_dagster.checks.row_count import CountRead, verdict
from siphon_dagster.checks.schema_parity import compare
from siphon_dagster.targets.base import BucketDigest, SourceColumn, TableSchema, TargetColumn, TargetRow


@pytest.mark.parametrize(("source", "c1", "c2", "t2", "drift", "settled"), [
    (100, 100, 0, 0, False, True),  # converged
    (100, 98, 2, 0, False, True),  # two rows updated after the read
    (100, 97, 5, 1, False, False),  # inserts and a delete after the read: in flight
    (100, 101, 0, 0, True, False),  # a row at the target the source never had
    (100, 95, 2, 1, True, False),  # rows missing even counting every change after the read
    (0, 0, 0, 0, False, True),
])
def test_count_band(source, c1, c2, t2, drift, settled):
    band = CountBand(source, c1, c2, t2)
    assert band.drift is drift
    assert band.settled is settled


@pytest.mark.parametrize(("rows", "digits"), [(0, 1), (25_599, 1), (25_600, 2), (409_600, 3), (10_000_000, 4),
                                              (10**9, 5)])
def test_bucket_digits_keep_at_least_100_rows_a_bucket(rows, digits):
    assert bucket_digits(rows) == digits


def test_mismatched_buckets_are_those_missing_on_either_side_or_different():
    source = {"a": BucketDigest(3, "x"), "b": BucketDigest(2, "y"), "c": BucketDigest(1, "z")}
    target = {"a": BucketDigest(3, "x"), "b": BucketDigest(2, "q"), "d": BucketDigest(1, "w")}
    assert mismatched_buckets(source, target) == ["b", "c", "d"]


def test_classify_names_each_kind_and_defers_keys_changed_after_the_read():
    version = 1000
    source = {("1",): SourceRow("h1", 0), ("2",): SourceRow("h2", 9), ("3",): SourceRow("h3", 17),
              ("4",): SourceRow("h4", 3), ("6",): SourceRow("h6", 3)}
    target = {
        ("1",): TargetRow("h1", 10, False),  # equal
        ("2",): TargetRow("other", 20, False),  # differs at a version the stream had passed
        # ("3",) missing entirely
        ("4",): TargetRow("newer", 2000, False),  # changed after the read: in flight
        ("5",): TargetRow("h5", 1, False),  # extra
        ("6",): TargetRow(None, 2000, True),  # deleted after the read: in flight
        ("7",): TargetRow(None, 50, True),  # deleted at both ends
    }
    divergent, in_flight = classify(list(source) + list(target), source, target, version, blocks_per_partition=8)
    assert divergent == [DivergentKey(("2",), DIFFERS, "00000008-00000015"),
                         DivergentKey(("3",), MISSING, "00000016-00000023"),
                         DivergentKey(("5",), EXTRA, None)]
    assert in_flight == [("4",), ("6",)]


class Rereads:
    """Later reads of some keys, in order, recording which keys each round asked for."""

    def __init__(self, *reads: KeyRead | None):
        self.reads, self.asked = list(reads), []

    def __call__(self, keys):
        self.asked.append(sorted(keys))
        return self.reads.pop(0)


def test_a_key_one_read_finds_extra_is_not_divergent_when_the_next_read_sees_its_commit():
    # The first read missed a commit below its position (not yet visible); the target holds its row.
    first, _ = classify([("9",)], {}, {("9",): TargetRow("h9", 900, False)}, 1000, blocks_per_partition=8)
    assert first == [DivergentKey(("9",), EXTRA, None)]
    rereads = Rereads(KeyRead({("9",): SourceRow("h9", 2)}, {("9",): TargetRow("h9", 900, False)}, 1100))
    settled = settle(first, [], rereads, attempts=3, blocks_per_partition=8)
    assert (settled.divergent, settled.in_flight, settled.rounds) == ([], [], 1)
    assert rereads.asked == [[("9",)]]


def test_a_key_two_reads_find_divergent_is_reported_and_keys_in_flight_get_their_rounds():
    stale = TargetRow("old", 10, False)
    first = [DivergentKey(("2",), DIFFERS, "00000000-00000007")]
    rereads = Rereads(
        # Round 1: "2" still differs; "4" is still changing; "5" settled equal.
        KeyRead({("2",): SourceRow("h2", 1), ("4",): SourceRow("h4", 1), ("5",): SourceRow("h5", 1)},
                {("2",): stale, ("4",): TargetRow("x", 1500, False), ("5",): TargetRow("h5", 1200, False)}, 1100),
        # Round 2 (the last for keys in flight): "4" now differs at a version the read had passed.
        KeyRead({("4",): SourceRow("h4", 1)}, {("4",): TargetRow("x", 1500, False)}, 1600),
        # Round 3, past the attempts, only for "4": it still differs.
        KeyRead({("4",): SourceRow("h4", 1)}, {("4",): TargetRow("x", 1500, False)}, 1700),
    )
    settled = settle(first, [("4",), ("5",)], rereads, attempts=2, blocks_per_partition=8)
    assert settled.divergent == [DivergentKey(("2",), DIFFERS, "00000000-00000007"),
                                 DivergentKey(("4",), DIFFERS, "00000000-00000007")]
    assert (settled.in_flight, settled.rounds) == ([], 3)
    assert rereads.asked == [[("2",), ("4",), ("5",)], [("4",)], [("4",)]]


def test_keys_still_changing_after_the_rounds_stay_in_flight_and_a_stream_behind_reports_what_one_read_found():
    changing = KeyRead({("4",): SourceRow("h4", 1)}, {("4",): TargetRow("x", 5000, False)}, 1100)
    settled = settle([], [("4",)], Rereads(changing, changing), attempts=2, blocks_per_partition=8)
    assert (settled.divergent, settled.in_flight, settled.rounds) == ([], [("4",)], 2)

    first = [DivergentKey(("3",), MISSING, "00000000-00000007")]
    settled = settle(first, [("4",)], Rereads(None), attempts=3, blocks_per_partition=8)
    assert (settled.divergent, settled.in_flight, settled.rounds) == (first, [("4",)], 1)


def test_partition_key_of_a_block():
    assert partition_key(0, 8192) == "00000000-00008191"
    assert partition_key(8192, 8192) == "00008192-00016383"
    assert partition_key(20_000, 8192) == "00016384-00024575"


def test_report_partitions_are_distinct_and_sorted():
    report = ParityReport(divergent=[DivergentKey(("1",), MISSING, "00000008-00000015"),
                                     DivergentKey(("2",), EXTRA, None),
                                     DivergentKey(("3",), DIFFERS, "00000000-00000007"),
                                     DivergentKey(("4",), DIFFERS, "00000008-00000015")])
    assert report.partitions == ["00000000-00000007", "00000008-00000015"]


def test_schema_comparison_names_missing_extra_and_retyped_columns():
    table = TableSchema("public", "notes", (SourceColumn("id", 20, "bigint", primary_key=True),
                                            SourceColumn("body", 25, "text"), SourceColumn("added", 23, "integer")))
    stored = [TargetColumn("id", "Int64"), TargetColumn("body", "Int32"), TargetColumn("gone", "String"),
              TargetColumn("_siphon_version", "UInt128"), TargetColumn("_siphon_deleted", "UInt8"),
              TargetColumn("_siphon_backfill_x", "String")]
    expected = {"id": "Int64", "body": "Nullable(String)", "added": "Nullable(Int32)"}
    matches = {"id": True, "body": False, "added": False}
    missing, extra, retyped = compare(table, stored, expected, matches)
    assert missing == ["added", "_siphon_synced_at"]
    assert extra == ["gone"]
    assert retyped == ["body: expected Nullable(String), found Int32"]


@pytest.fixture
def config():
    return parse_config({"application_identifier": "a", "source": {"dsn": "postgresql://x@127.0.0.1:1/x"},
                         "tables": [{"name": "public.notes"}, {"name": "public.issues", "targets": ["clickhouse"]}],
                         "targets": {"clickhouse": {}, "snowflake": {"account": "a", "user": "u"}}})


def test_selected_keys_default_to_every_check_of_every_target(config):
    keys = selected_keys(config, None, None)
    assert len(keys) == 3 * 4
    assert {k.asset_key.to_user_string() for k in keys} == {"clickhouse/public/notes", "snowflake/public/notes",
                                                             "clickhouse/public/issues"}


def test_selected_keys_refuse_unknown_tables_and_targets_naming_the_configured_ones(config):
    with pytest.raises(ValueError, match="public.nope is not in the configuration; its tables are: public.notes, "
                                         "public.issues"):
        selected_keys(config, "public.nope", None)
    with pytest.raises(ValueError, match="target bigquery is not configured; the configured targets are: "
                                         "clickhouse, snowflake"):
        selected_keys(config, None, "bigquery")
    with pytest.raises(ValueError, match="not replicated to target snowflake"):
        selected_keys(config, "public.issues", "snowflake")


def test_checks_config_defaults_and_errors():
    base = {"application_identifier": "a", "source": {"dsn": "postgresql://x@127.0.0.1:1/x"}, "tables": [{"name": "public.t"}]}
    checks = parse_config(base).checks
    assert checks.enabled and checks.schedule == "0 * * * *"
    with pytest.raises(ConfigError, match="checks.schedule"):
        parse_config({**base, "checks": {"schedule": "hourly"}})
    with pytest.raises(ConfigError, match="checks.freshness_warn_seconds"):
        parse_config({**base, "checks": {"freshness_warn_seconds": 0}})


@pytest.mark.parametrize("enabled", [True, False])
def test_every_target_asset_has_the_four_checks_and_a_schedule(enabled):
    import dagster as dg

    from siphon_dagster.definitions import build_definitions

    config = parse_config({"application_identifier": "dev.main", "source": {"dsn": "postgresql://x@127.0.0.1:1/x"},
                           "tables": [{"name": 'public.we"ird'}, {"name": "audit.events"}],
                           "targets": {"clickhouse": {}, "snowflake": {"account": "a", "user": "u"}},
                           "checks": {"enabled": enabled, "schedule": "*/30 * * * *"}})
    definitions = build_definitions(config)
    keys = {(key.asset_key.to_user_string(), key.name)
            for check in definitions.asset_checks for key in check.check_keys}
    assert len(keys) == 2 * 2 * 4
    assert ('clickhouse/public/we"ird', "row_parity") in keys and ("snowflake/audit/events", "freshness") in keys
    schedule = definitions.resolve_schedule_def("siphon_dev_main_checks")
    assert schedule.cron_schedule == "*/30 * * * *"
    assert schedule.default_status == (dg.DefaultScheduleStatus.RUNNING if enabled else dg.DefaultScheduleStatus.STOPPED)
    assert schedule.job_name == "siphon_dev_main_checks_job"


# --- row count: the exact comparison of a busy table -------------------------------------------------
@pytest.mark.parametrize(("source", "unchanged", "changed", "held", "difference"), [
    (100, 100, 0, 0, 0),  # quiet and converged
    (100, 90, 14, 10, 0),  # busy: 10 keys the read holds changed since, 4 inserted after it
    (100, 88, 14, 10, -2),  # busy, and 2 rows deleted by hand at the target: inside the band, still drift
    (100, 91, 12, 10, 1),  # busy, and a row added by hand
    (100, 0, 100, 100, 0),  # every row changed since the read (a TRUNCATE after it)
])
def test_exact_count_difference(source, unchanged, changed, held, difference):
    assert ExactCount(source, unchanged, changed, held).difference == difference


def _read(source, c1, c2, t2, exact=None, why="more than 10 keys changed since the read"):
    band = CountBand(source, c1, c2, t2)
    if exact is None:
        return CountRead(band, None, why)
    changed, held = exact
    return CountRead(band, ExactCount(source, c1, changed, held))


def test_row_count_passes_an_exact_match_on_a_busy_table_at_once():
    outcome = verdict([_read(100, 90, 6, 4, exact=(14, 10))], attempts=3)
    assert outcome is not None and outcome.passed
    assert outcome.summary == "100 rows at both ends (14 keys changed since the read, compared at it)"


def test_row_count_fails_drift_inside_the_in_flight_band_once_two_reads_disagree_exactly():
    # 2 rows deleted by hand among the unchanged ones: the band (88 <= 100 <= 88 + 6 + 8) cannot see it.
    first = _read(100, 88, 6, 8, exact=(14, 10))
    assert not first.band.drift
    assert verdict([first], attempts=3) is None  # read again: one disagreement is not yet a verdict
    outcome = verdict([first, _read(101, 87, 8, 8, exact=(16, 12))], attempts=3)
    assert outcome is not None and not outcome.passed and outcome.severity == ERROR
    assert outcome.summary.startswith("drift: 2 rows missing at the target among keys unchanged since the source's "
                                      "read: source 101 rows, of which 89 unchanged since the read; target 87")


def test_row_count_fails_a_single_exact_disagreement_when_no_read_is_left():
    outcome = verdict([_read(400, 401, 0, 0, exact=(0, 0))], attempts=1)
    assert outcome is not None and not outcome.passed and "1 rows extra at the target" in outcome.summary


def test_row_count_passes_once_a_later_read_matches():
    reads = [_read(100, 88, 6, 8, exact=(14, 10)), _read(100, 90, 6, 4, exact=(14, 10))]
    assert verdict(reads, attempts=3).passed


def test_row_count_without_an_exact_read_fails_only_band_drift_and_otherwise_warns():
    inside = [_read(100, 97, 5, 1), _read(100, 96, 6, 1), _read(100, 96, 6, 1)]
    assert verdict(inside[:2], attempts=3) is None
    outcome = verdict(inside, attempts=3)
    assert outcome is not None and not outcome.passed and outcome.severity == WARN
    assert "could not compare exactly in 3 reads (more than 10 keys changed since the read)" in outcome.summary
    outside = [_read(100, 101, 0, 0)] * 3
    drift = verdict(outside, attempts=3)
    assert not drift.passed and drift.severity == ERROR and drift.summary.startswith("drift: source 100 rows")
