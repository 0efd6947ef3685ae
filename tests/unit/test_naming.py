import pytest

from siphon_core import naming


def test_stream_and_subjects_follow_the_documented_names():
    assert naming.stream_name("dev.main.1") == "SIPHON_DEV_MAIN_1"
    assert naming.table_subject("dev.main.1", "public", "notes") == "siphon.dev%2Emain%2E1.public.notes"


@pytest.mark.parametrize("identifier", ["we.ird", "sp ace", "star*", "gt>", "per%cent", "", "ünïcødé", "tab\tx"])
def test_any_identifier_is_one_subject_token(identifier):
    token = naming.escape_subject_token(identifier)
    assert token and not any(ch in token for ch in ".*> \t")


def test_escaping_keeps_distinct_identifiers_distinct():
    names = ["a.b", "a%2Eb", "a_b", "a b"]
    assert len({naming.escape_subject_token(n) for n in names}) == len(names)


@pytest.mark.parametrize(
    ("schema", "table", "asset", "stream"),
    [
        ("public", "notes", "clickhouse/public/notes", "stream_clickhouse_notes"),
        ("audit", "events", "clickhouse/audit/events", "stream_clickhouse_audit__events"),
        ("public", "Merge Requests!", "clickhouse/public/Merge Requests!", "stream_clickhouse_Merge_Requests_"),
    ],
)
def test_job_and_asset_names(schema, table, asset, stream):
    assert naming.asset_path_text("clickhouse", schema, table) == asset
    assert naming.stream_job_name("clickhouse", schema, table) == stream
    assert f"materialize every partition of asset {asset} " in naming.resnapshot_advice("clickhouse", schema, table)
    assert f"--target clickhouse --table {schema}.{table}`" in naming.rebuild_advice("clickhouse", schema, table)


def test_versions_order_by_lsn_then_position():
    assert naming.row_version(0x10, 0) < naming.row_version(0x10, 1) < naming.row_version(0x11, 0)
    assert naming.split_version(naming.row_version(0xABCDEF0123, 77)) == (0xABCDEF0123, 77)
    assert naming.row_version(2**64 - 1, 2**32 - 1) < 10**38  # fits NUMBER(38, 0)


def test_lsn_text_round_trip():
    assert naming.parse_lsn("16/B374D848") == 0x16B374D848
    assert naming.format_lsn(0x16B374D848) == "16/B374D848"


def test_slot_and_consumer_names_are_valid_and_distinct():
    a, b = naming.slot_name("Dev.Main-1"), naming.slot_name("dev.main-1")
    assert a != b and len(a) <= 63 and a == a.lower()
    assert naming.consumer_name("clickhouse", "public", "a.b") != naming.consumer_name("clickhouse", "public", "a_b")


def test_advisory_lock_key_is_a_signed_64_bit_integer():
    key = naming.advisory_lock_key("dev.main.1")
    assert -(2**63) <= key < 2**63
    assert key == naming.advisory_lock_key("dev.main.1") != naming.advisory_lock_key("dev.main.2")


def test_the_application_of_a_subject_is_the_identifier_it_was_made_from() -> None:
    for identifier in ("dev.main.1", "probe_app_1", "a-b", "x%y"):
        assert naming.application_of_subject(naming.subject_prefix(identifier) + ".>") == identifier
