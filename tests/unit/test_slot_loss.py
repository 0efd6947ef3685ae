"""What start-up does with a lost replication slot, decided apart from any server; the gap
record's format; the names it travels under."""

from dataclasses import replace

import dagster as dg
import pytest

from producer_service.slot_loss import Plan, SlotState, plan
from siphon_core import naming
from siphon_core.config import ConfigError, parse_config
from siphon_core.gaps import LOST, RESUMED, GapRecordError, SlotGap
from siphon_core.queue import StreamSettings

HEALTHY = SlotState(exists=True, confirmed_flush_lsn=0x1000)
MISSING = SlotState(exists=False)
INVALIDATED = SlotState(exists=True, invalidation="wal_status=lost", confirmed_flush_lsn=0x500)
OPEN_GAP = SlotGap("app", "slot", LOST, "missing", "2026-01-01T00:00:00.000+00:00")
CLOSED_GAP = SlotGap("app", "slot", RESUMED, "missing", "2026-01-01T00:00:01.000+00:00", consistent_point="0/2000",
                     lost_sequence=7)
RECORD_AND_REPLACE = Plan(record_lost=True, create_slot=True, record_resumed=True)


@pytest.mark.parametrize(("slot", "last_sequence", "newest_gap", "mode", "accepted", "expected"), [
    # A usable slot streams, whatever the queue holds.
    (HEALTHY, 120, None, "resync", False, Plan()),
    (HEALTHY, 120, CLOSED_GAP, "stop", False, Plan()),
    # A first start: nothing ever streamed, so nothing was missed; stop does not apply.
    (MISSING, 0, None, "resync", False, Plan(create_slot=True)),
    (MISSING, 0, None, "stop", False, Plan(create_slot=True)),
    (INVALIDATED, 0, None, "stop", False, Plan(drop_slot=True, create_slot=True)),
    # The application streamed before: the loss is recorded before a new slot is made.
    (MISSING, 120, None, "resync", False, RECORD_AND_REPLACE),
    (INVALIDATED, 120, None, "resync", False, Plan(record_lost=True, drop_slot=True, create_slot=True,
                                                   record_resumed=True)),
    (MISSING, 120, CLOSED_GAP, "resync", False, RECORD_AND_REPLACE),  # a second loss after an earlier gap
    # stop: nothing changes, unless the operator accepted the loss.
    (MISSING, 120, None, "stop", False, Plan(refuse=True)),
    (INVALIDATED, 120, None, "stop", False, Plan(refuse=True)),
    (MISSING, 120, None, "stop", True, RECORD_AND_REPLACE),
    # A `lost` record without its `resumed` one: the previous producer died in between; finish it.
    (MISSING, 121, OPEN_GAP, "stop", False, Plan(create_slot=True, record_resumed=True)),
    (INVALIDATED, 121, OPEN_GAP, "resync", False, Plan(drop_slot=True, create_slot=True, record_resumed=True)),
    (HEALTHY, 121, OPEN_GAP, "resync", False, Plan(record_resumed=True)),  # died after making the slot
])
def test_plan(slot, last_sequence, newest_gap, mode, accepted, expected):
    assert plan(slot, last_sequence, newest_gap, mode, accepted) == expected


def test_a_plan_never_streams_a_new_slot_of_a_streamed_application_without_recording_it():
    for slot in (MISSING, INVALIDATED):
        for newest in (None, OPEN_GAP, CLOSED_GAP):
            for mode in ("resync", "stop"):
                for accepted in (False, True):
                    decision = plan(slot, 5, newest, mode, accepted)
                    assert decision.refuse or (decision.create_slot and decision.record_resumed), decision


def test_gap_records_round_trip_and_ids_are_deterministic():
    assert SlotGap.from_json(CLOSED_GAP.to_json(), "here") == CLOSED_GAP
    assert CLOSED_GAP.message_id() == "gap:slot:resumed:0/2000"
    assert OPEN_GAP.message_id() == OPEN_GAP.message_id() != CLOSED_GAP.message_id()


@pytest.mark.parametrize("data", [b"not json", b"[]", b'{"slot": "s"}',
                                  b'{"application_identifier": "a", "slot": "s", "stage": "resumed", '
                                  b'"reason": "missing", "recorded_at": "t"}'])
def test_a_message_that_is_not_a_gap_record_is_refused_by_name(data):
    with pytest.raises(GapRecordError, match="stream message 9"):
        SlotGap.from_json(data, "stream message 9")


def test_the_gap_subject_is_in_the_stream_and_no_table_subject_can_be_it():
    subject = naming.gap_subject("dev.main.1")
    assert subject == "siphon.dev%2Emain%2E1.gaps" and len(subject.split(".")) == 3
    assert all(len(naming.table_subject("dev.main.1", schema, table).split(".")) == 4
               for schema, table in [("gaps", "x"), ("a.b", "c.d"), ("", "")])
    prefix = StreamSettings("dev.main.1").subjects[0]
    assert prefix.endswith(".>") and subject.startswith(prefix[:-1])


@pytest.mark.parametrize(("schema", "table", "job"), [
    ("public", "notes", "resync_notes"),
    ("audit", "events", "resync_audit__events"),
    ("Sales", "Order Lines", "resync_Sales__Order_Lines"),
    ("public", 'we"ird', "resync_we_ird"),
])
def test_resync_job_names(schema, table, job):
    assert naming.resync_job_name(schema, table) == job
    assert naming.stream_job_name("clickhouse", schema, table) == "stream_clickhouse_" + job.removeprefix("resync_")
    dg.op(name=job)(lambda: None)  # a valid Dagster name (this raises otherwise)


def test_the_gap_sensor_is_named_as_the_producer_says():
    from siphon_dagster.gap_sensor import build_gap_sensor
    from siphon_dagster.specs import group_name

    for identifier in ("dev.main-1", "app"):
        assert build_gap_sensor([], group_name(identifier)).name == naming.gap_sensor_name(identifier)


def test_on_slot_lost_is_resync_by_default_and_checked():
    raw = {"application_identifier": "a", "source": {"dsn": "postgresql://x"}, "tables": [{"name": "public.t"}]}
    assert parse_config(raw).producer.on_slot_lost == "resync"
    assert parse_config({**raw, "producer": {"on_slot_lost": "stop"}}).producer.on_slot_lost == "stop"
    with pytest.raises(ConfigError, match=r"producer\.on_slot_lost: .*'resync' or 'stop'"):
        parse_config({**raw, "producer": {"on_slot_lost": "ignore"}})


def test_the_sensor_observes_every_target_asset_and_requests_every_table_once():
    from siphon_dagster.gap_sensor import GAP_TAG, gap_observations, resync_requests
    from siphon_dagster.resync_requests import RESYNC_TAG, ResyncRequests
    from siphon_dagster.specs import table_specs

    config = parse_config({
        "application_identifier": "app", "source": {"dsn": "postgresql://x"},
        "tables": [{"name": "public.notes"}, {"name": "audit.events", "targets": ["clickhouse"]}],
        "targets": {"clickhouse": {}, "snowflake": {"account": "a", "user": "u"}},
    })
    specs = table_specs(config)

    @dg.op
    def noop() -> None:
        pass

    resyncs = ResyncRequests.of(dg.GraphDefinition(name="siphon_app_resync", node_defs=[noop]).to_job(), specs)
    gap = replace(CLOSED_GAP, last_streamed_lsn="0/1800")

    observations = gap_observations(specs, 12, gap, resyncs)
    requests = resync_requests(specs, 12, resyncs)

    assert sorted(o.asset_key.to_user_string() for o in observations) == [
        "clickhouse/audit/events", "clickhouse/public/notes", "snowflake/public/notes"]
    notes = observations[0]
    assert notes.metadata["gap_lsn"].value == "0/2000" and notes.metadata["gap_sequence"].value == 12
    assert "after 0/1800 and before 0/2000" in notes.description
    assert "siphon_app_resync for public.notes requested" in notes.description
    assert [(r.job_name, r.tags[GAP_TAG], r.tags[RESYNC_TAG], r.run_key) for r in requests] == [
        ("siphon_app_resync", "12", "public.notes", "slot-gap-12-resync_notes"),
        ("siphon_app_resync", "12", "audit.events", "slot-gap-12-resync_audit__events")]
    # The run config names the table: the one listed job rebuilds whichever table it is told.
    assert [r.run_config for r in requests] == [{"ops": {"rebuild": {"config": {"table": "public.notes"}}}},
                                                {"ops": {"rebuild": {"config": {"table": "audit.events"}}}}]
    stranger = replace(specs[0], table=specs[0].table.model_copy(update={"name": "public.stranger"}))
    with pytest.raises(ValueError, match=r"does not know public\.stranger; it knows \['audit\.events', 'public\.notes'\]"):
        resyncs.request(stranger, run_key="x")
