"""Queue consumers of tables that are no longer replicated, and tables that come back.

Every (target, table) has a durable JetStream consumer that keeps the table's position in the
stream. A table removed from siphon.yaml (or from one target) leaves its consumer behind: it
takes one of the stream's `queue.max_consumers`, and the server keeps its state. The streaming
sensor sweeps them: a consumer of this application's table subjects that no configured (target,
table) owns and no live run serves is recorded on the table's target asset, and deleted once it
has been idle for a while.

A table added again has missed the changes committed while it was not published: its stream
alone cannot bring it back. The sensor remembers the tables it recorded as removed (its cursor),
and requests a resync of one that is configured again, which rebuilds it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

import dagster as dg
from nats.js.api import ConsumerInfo

from siphon_core import naming
from siphon_core.config import TARGET_NAMES
from siphon_dagster.resync_requests import ResyncRequests
from siphon_dagster.specs import TableSpec

# Metadata of the observation a removed consumer leaves on its target asset.
UNREPLICATED_METADATA = "siphon/unreplicated"
# Metadata of the observation that answers it when the table is replicated again.
READDED_METADATA = "siphon/added-again"
READDED_TAG = "siphon/added-again"  # on the resync run requested: the table id (`<target>:<schema>.<table>`)
# Observations of a target asset read for a removal record a reset cursor forgot (the snapshot
# sensor records a few state changes of its own once the table is back).
_OBSERVATIONS_READ = 20
# A removed table's consumer is kept this long after its last delivery or ack: the run that
# served it ends first, and a table put back at once keeps its place.
IDLE_BEFORE_REMOVAL_SECONDS = 600.0


@dataclass(frozen=True)
class TableConsumer:
    """A durable consumer of one of the application's table subjects, as the queue lists it."""

    name: str
    target: str
    schema: str
    table: str
    created: float  # Unix seconds
    last_active: float  # the latest of its creation, last delivery and last ack
    acked_sequence: int
    pending: int

    @property
    def qualified_name(self) -> str:
        return f"{self.schema}.{self.table}"

    @property
    def asset_key(self) -> dg.AssetKey:
        return dg.AssetKey(naming.asset_key_path(self.target, self.schema, self.table))


def _seconds(moment: datetime | None) -> float:
    return moment.timestamp() if moment is not None else 0.0


def table_consumers(infos: Iterable[ConsumerInfo], application: str) -> list[TableConsumer]:
    """The consumers Siphon made for this application's tables: named as Siphon names a
    (target, table) consumer and filtering that table's subject. Any other consumer is not ours."""
    found = []
    for info in infos:
        subject = info.config.filter_subject or ""
        table = naming.table_of_subject(application, subject)
        if table is None:
            continue
        target = next((t for t in TARGET_NAMES if naming.consumer_name(t, *table) == info.name), None)
        if target is None:
            continue
        created = _seconds(info.created)
        delivered = info.delivered.last_active if info.delivered is not None else None
        acked = info.ack_floor.last_active if info.ack_floor is not None else None
        found.append(TableConsumer(
            name=info.name, target=target, schema=table[0], table=table[1], created=created,
            last_active=max(created, _seconds(delivered), _seconds(acked)),
            acked_sequence=int(info.ack_floor.stream_seq or 0) if info.ack_floor is not None else 0,
            pending=int(info.num_pending or 0) + int(info.num_ack_pending or 0)))
    return found


def table_id(target: str, qualified_name: str) -> str:
    return f"{target}:{qualified_name}"


@dataclass(frozen=True)
class SweepPlan:
    newly_unreplicated: list[TableConsumer]  # to record on their target assets
    to_delete: list[TableConsumer]
    added_again: list[str]  # table ids (`<target>:<schema>.<table>`) recorded as removed and now configured


def plan_sweep(consumers: Iterable[TableConsumer], configured: Collection[tuple[str, str]],
               served: Collection[tuple[str, str]], removed: Mapping[str, float], now: float,
               idle_seconds: float = IDLE_BEFORE_REMOVAL_SECONDS) -> SweepPlan:
    """`configured`: the (target, table) pairs of the configuration; `served`: those a live run
    applies; `removed`: table ids already recorded as no longer replicated, and when. A consumer of
    a pair neither configured nor served is recorded at once (a table put back later is rebuilt
    even when its consumer was still there) and deleted once idle for `idle_seconds`."""
    newly, to_delete = [], []
    for consumer in consumers:
        pair = (consumer.target, consumer.qualified_name)
        if pair in configured or pair in served:
            continue
        if table_id(*pair) not in removed:
            newly.append(consumer)
        if now - consumer.last_active >= idle_seconds:
            to_delete.append(consumer)
    again = sorted(name for name in removed if tuple(name.split(":", 1)) in configured)
    return SweepPlan(newly, to_delete, again)


def removal_record(consumer: TableConsumer) -> dg.AssetObservation:
    return dg.AssetObservation(
        asset_key=consumer.asset_key,
        description=(f"{consumer.qualified_name} is no longer replicated to {consumer.target}; the table at the "
                     f"target is kept as it is. Its queue consumer {consumer.name} (acked up to stream sequence "
                     f"{consumer.acked_sequence}, {consumer.pending} messages not applied) is removed once idle. "
                     "Added again, the table is rebuilt (a resync): changes made meanwhile never reach the queue"),
        metadata={UNREPLICATED_METADATA: True, "consumer": consumer.name,
                  "acked_stream_sequence": consumer.acked_sequence, "pending_messages": consumer.pending})


def added_again(target: str, spec: TableSpec, removed_at: float,
                resyncs: ResyncRequests) -> tuple[dg.RunRequest, dg.AssetObservation]:
    """The resync run of a table replicated again after it was removed, and its record."""
    name = table_id(target, spec.qualified_name)
    request = resyncs.request(spec, run_key=f"added-again-{name}-{removed_at:.0f}", tags={READDED_TAG: name})
    job = resyncs.describe(spec)
    record = dg.AssetObservation(
        asset_key=spec.target_key(target),
        description=(f"{spec.qualified_name} is replicated to {target} again after it was removed: {job} "
                     "requested to rebuild it, as changes made meanwhile never reached the queue"),
        metadata={READDED_METADATA: True, "removed_at": removed_at, "action": f"resync requested: {job}"})
    return request, record


def forgotten_removal(instance: dg.DagsterInstance, target: str, schema: str, table: str) -> float | None:
    """For a sensor whose cursor was reset: when the table's latest observations at the target hold
    a removal record that nothing answered since (a record of its return, a load), the record's
    time; otherwise None."""
    asset_key = dg.AssetKey(naming.asset_key_path(target, schema, table))
    for record in instance.fetch_observations(asset_key, limit=_OBSERVATIONS_READ).records:  # newest first
        metadata = record.asset_observation.metadata if record.asset_observation is not None else {}
        if READDED_METADATA in metadata:
            return None
        if UNREPLICATED_METADATA in metadata:
            loaded = instance.get_latest_materialization_event(asset_key)
            if loaded is not None and loaded.storage_id is not None and loaded.storage_id > record.storage_id:
                return None
            return record.timestamp
    return None
