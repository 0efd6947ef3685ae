"""Which queue consumers belong to tables no longer replicated, and which tables came back."""

from __future__ import annotations

from nats.js.api import ConsumerInfo

from siphon_core import naming
from siphon_dagster.consumer_sweep import TableConsumer, plan_sweep, table_consumers

APP = "shop.eu-1"
NOW = 1_800_000_000.0


def info(name: str, subject: str, created: str = "2027-01-15T08:00:00Z", acked_at: str | None = None) -> ConsumerInfo:
    return ConsumerInfo.from_response({
        "name": name, "stream_name": "SIPHON_SHOP_EU_1", "created": created,
        "config": {"durable_name": name, "filter_subject": subject},
        "delivered": {"consumer_seq": 9, "stream_seq": 40},
        "ack_floor": {"consumer_seq": 7, "stream_seq": 31, **({"last_active": acked_at} if acked_at else {})},
        "num_pending": 3, "num_ack_pending": 2})


def test_only_consumers_siphon_named_for_a_table_of_this_application_are_its_tables_consumers() -> None:
    ours = info(naming.consumer_name("snowflake", "Sales Ü", "order.lines"),
                naming.table_subject(APP, "Sales Ü", "order.lines"), acked_at="2027-01-15T09:30:00Z")
    other_app = info(naming.consumer_name("clickhouse", "public", "t"), naming.table_subject("other", "public", "t"))
    hand_made = info("my_tap", naming.table_subject(APP, "public", "t"))
    gaps = info(naming.consumer_name("clickhouse", "public", "t"), naming.gap_subject(APP))
    [found] = table_consumers([ours, other_app, hand_made, gaps], APP)
    assert (found.target, found.schema, found.table) == ("snowflake", "Sales Ü", "order.lines")
    assert found.acked_sequence == 31 and found.pending == 5
    assert found.last_active - found.created == 90 * 60  # the ack after its creation


def consumer(table: str, target: str = "clickhouse", idle: float = 0.0) -> TableConsumer:
    schema, name = table.split(".")
    return TableConsumer(naming.consumer_name(target, schema, name), target, schema, name,
                         created=NOW - idle - 10, last_active=NOW - idle, acked_sequence=1, pending=0)


def test_a_consumer_not_configured_nor_served_is_recorded_once_and_deleted_once_idle() -> None:
    configured = {("clickhouse", "public.kept")}
    consumers = [consumer("public.kept", idle=5000), consumer("public.gone", idle=30),
                 consumer("public.old", idle=601), consumer("public.moving", idle=5000),
                 consumer("public.kept", target="snowflake", idle=5000)]
    plan = plan_sweep(consumers, configured, served={("clickhouse", "public.moving")},
                      removed={"clickhouse:public.old": NOW - 900}, now=NOW, idle_seconds=600)
    # The configured pair and the one a live run still serves are left alone; a table removed
    # from one target only loses that target's consumer.
    assert [c.qualified_name + "@" + c.target for c in plan.newly_unreplicated] == \
        ["public.gone@clickhouse", "public.kept@snowflake"]
    assert [c.qualified_name + "@" + c.target for c in plan.to_delete] == \
        ["public.old@clickhouse", "public.kept@snowflake"]
    assert plan.added_again == []


def test_a_table_recorded_as_removed_and_configured_again_is_added_again() -> None:
    plan = plan_sweep([consumer("public.back")], {("clickhouse", "public.back")}, served=set(),
                      removed={"clickhouse:public.back": NOW - 60, "snowflake:public.back": NOW - 60}, now=NOW)
    assert plan.added_again == ["clickhouse:public.back"]
    assert plan.newly_unreplicated == [] and plan.to_delete == []
