"""A lost replication slot never hides a gap.

When the producer's slot is missing (dropped by an operator, a failover to a server without it) or
invalidated (`max_slot_wal_keep_size`, a recovery conflict), the changes since its last confirmed
position can no longer be read. A new slot only streams what commits after its consistent point.
Whether that is a gap depends on whether the application streamed before; the producer keeps no
local state, so the queue is its memory: a stream whose last sequence is above 0 once held packages.

The order of the steps is what makes a crash at any point safe:

1. publish a `lost` gap record and wait for its ack, before anything changes at the source;
2. drop the invalidated slot, create the new one (its consistent point);
3. publish a `resumed` record with that consistent point and wait for its ack;
4. only then stream from the new slot.

A producer that dies after step 1 finds, at its next start, a `lost` record as the newest gap record
(no `resumed` after it) and finishes steps 2-3 whatever state the slot is in: a healthy slot there
can only be the one made in step 2 (nothing streams before step 3), so its confirmed position is
still its consistent point. A producer that dies before step 1 changed nothing. So a new slot never
streams without a `resumed` record before its first package.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, replace
from typing import Any

import psycopg

from producer_service.metrics import ProducerMetrics
from producer_service.publication import SourceSetupError, check_slot_kind, create_slot
from siphon_core import naming
from siphon_core.config import TableConfig
from siphon_core.gaps import LOST, RESUMED, GapRecordError, SlotGap
from siphon_core.logs import get_logger
from siphon_core.queue import JetStreamQueue, QueueError
from siphon_core.replication import ReplicationError
from siphon_core.wire.packages import PackageError, decode_package

log = get_logger("producer")

_PUBLISH_TIMEOUT_SECONDS = 10.0


class SlotLostError(SourceSetupError):
    """The slot was lost and `producer.on_slot_lost` is `stop`: nothing was changed."""


@dataclass(frozen=True)
class SlotState:
    exists: bool
    # Why the server will no longer stream from it (e.g. "wal_status=lost"); None when usable.
    invalidation: str | None = None
    confirmed_flush_lsn: int | None = None

    @property
    def lost(self) -> bool:
        return not self.exists or self.invalidation is not None

    @property
    def reason(self) -> str:
        return "invalidated" if self.exists else "missing"


@dataclass(frozen=True)
class Plan:
    """What start-up does with the slot, in this order."""

    refuse: bool = False          # `stop`: exit and change nothing
    record_lost: bool = False     # publish a `lost` record first
    drop_slot: bool = False       # the invalidated slot goes before a new one is made
    create_slot: bool = False
    record_resumed: bool = False  # publish the new slot's consistent point before streaming


def plan(slot: SlotState, last_sequence: int | None, newest_gap: SlotGap | None, on_slot_lost: str,
         accepted: bool) -> Plan:
    """The decision, apart from any server: see the module's docstring for why each case is safe."""
    if newest_gap is not None and newest_gap.stage == LOST:
        # Recorded (so accepted) by a producer that died before recording the new slot: finish it.
        return Plan(drop_slot=slot.exists and slot.lost, create_slot=slot.lost, record_resumed=True)
    if not slot.lost:
        return Plan()
    if not last_sequence:
        # The application never streamed (a first start): no change can have been missed.
        return Plan(drop_slot=slot.exists, create_slot=True)
    if on_slot_lost == "stop" and not accepted:
        return Plan(refuse=True)
    return Plan(record_lost=True, drop_slot=slot.exists, create_slot=True, record_resumed=True)


def inspect_slot(connection: psycopg.Connection[Any], slot: str) -> SlotState:
    # to_jsonb reads the columns each server version has (invalidation_reason: 17+; conflicting: 16+).
    row = connection.execute("select to_jsonb(s) from pg_replication_slots s where slot_name = %s",
                             (slot,)).fetchone()
    if row is None:
        return SlotState(exists=False)
    info: dict[str, Any] = row[0]
    check_slot_kind(connection, slot, info.get("plugin"), info.get("database"))
    signs = []
    if info.get("wal_status") == "lost":
        signs.append("wal_status=lost")
    if info.get("invalidation_reason"):
        signs.append(f"invalidation_reason={info['invalidation_reason']}")
    if info.get("conflicting"):
        signs.append("conflicting=true")
    confirmed = info.get("confirmed_flush_lsn")
    return SlotState(True, ", ".join(signs) or None, naming.parse_lsn(confirmed) if confirmed else None)


def drop_slot(connection: psycopg.Connection[Any], slot: str) -> None:
    try:
        connection.execute("select pg_drop_replication_slot(%s)", (slot,))
    except psycopg.errors.ObjectInUse as error:
        # The walsender the server stopped when it invalidated the slot may still be exiting.
        raise ReplicationError(f"cannot drop the invalidated replication slot {slot!r} yet: "
                               f"{error.diag.message_primary}", error.sqlstate) from None
    except psycopg.errors.UndefinedObject:
        pass


class SlotGuard:
    """Makes sure the producer streams from a usable slot, recording a gap when one was lost."""

    def __init__(self, connection: psycopg.Connection[Any], queue: JetStreamQueue, application_identifier: str,
                 slot: str, tables: list[TableConfig], metrics: ProducerMetrics, on_slot_lost: str,
                 accepted: bool, config_path: str | None = None) -> None:
        self.connection = connection
        self.queue = queue
        self.application_identifier = application_identifier
        self.slot = slot
        self.tables = tables
        self.metrics = metrics
        self.on_slot_lost = on_slot_lost
        self.accepted = accepted
        self.config_path = config_path
        self.subject = naming.gap_subject(application_identifier)
        self.recorded_lost = False  # a `lost` record was published by this guard

    async def ensure(self) -> SlotGap | None:
        """Returns the `resumed` record published, if any; raises SlotLostError under `stop`."""
        state = inspect_slot(self.connection, self.slot)
        last_sequence = await self.queue.last_sequence()
        newest, newest_sequence = await self._newest_gap()
        decision = plan(state, last_sequence, newest, self.on_slot_lost, self.accepted)
        if decision.refuse:
            raise SlotLostError(self._refusal(state, last_sequence or 0, await self._last_streamed_lsn()))
        lost, lost_sequence = None, None
        if decision.record_resumed and not decision.record_lost:  # finishing a gap recorded before
            lost, lost_sequence = newest, newest_sequence
        if decision.record_lost:
            lost = SlotGap(self.application_identifier, self.slot, LOST, state.reason, _now(),
                           detail=state.invalidation, last_confirmed_lsn=_lsn_text(state.confirmed_flush_lsn),
                           last_streamed_lsn=_lsn_text(await self._last_streamed_lsn()))
            lost_sequence = await self._publish(lost)
            self.recorded_lost = True
            log.warning("replication slot lost; recorded on the queue before making a new one", slot=self.slot,
                        reason=state.reason, detail=state.invalidation or "", sequence=lost_sequence,
                        last_confirmed_lsn=lost.last_confirmed_lsn or "unknown",
                        last_streamed_lsn=lost.last_streamed_lsn or "unknown")
        if decision.drop_slot:
            drop_slot(self.connection, self.slot)
        consistent_point = state.confirmed_flush_lsn
        if decision.create_slot:
            consistent_point = create_slot(self.connection, self.slot)
            log.info("replication slot created", slot=self.slot, consistent_point=naming.format_lsn(consistent_point))
        if not decision.record_resumed:
            return None
        assert lost is not None and consistent_point is not None
        resumed = replace(lost, stage=RESUMED, recorded_at=_now(),
                          consistent_point=naming.format_lsn(consistent_point), lost_sequence=lost_sequence)
        sequence = await self._publish(resumed)
        self.metrics.slot_gaps.labels(reason=resumed.reason).inc()
        log.error("gap recorded: changes between the lost slot's last confirmed position and the new slot's "
                  "consistent point were not streamed; every table must be rebuilt (the Dagster gap sensor "
                  "requests a resync of each)", slot=self.slot, reason=resumed.reason,
                  last_confirmed_lsn=resumed.last_confirmed_lsn or "unknown",
                  last_streamed_lsn=resumed.last_streamed_lsn or "unknown",
                  consistent_point=resumed.consistent_point, subject=self.subject, sequence=sequence)
        return resumed

    async def _publish(self, gap: SlotGap) -> int:
        """Publishes and waits for the ack; any failure is a lost queue connection (retried)."""
        try:
            return await self.queue.publish(self.subject, gap.to_json(), gap.message_id(), _PUBLISH_TIMEOUT_SECONDS)
        except Exception as error:  # nats-py raises several unrelated types here
            raise QueueError(f"recording the {gap.stage} gap record of slot {self.slot!r} on {self.subject} "
                             f"failed: {error!r}") from None

    async def _last_streamed_lsn(self) -> int | None:
        """The last commit of the newest package in the queue; None when there is none or it cannot be read."""
        newest = await self.queue.last_table_message()
        if newest is None:
            return None
        sequence, data = newest
        try:
            return decode_package(data, f"stream message {sequence}").last_commit_lsn or None
        except PackageError as error:
            log.warning("cannot read the newest package for the gap record", error=str(error))
            return None

    async def _newest_gap(self) -> tuple[SlotGap | None, int | None]:
        newest = await self.queue.last_message(self.subject)
        if newest is None:
            return None, None
        sequence, data = newest
        try:
            gap = SlotGap.from_json(data, f"stream message {sequence} on {self.subject}")
        except GapRecordError as error:
            log.warning("ignoring a message that is not a gap record", error=str(error))
            return None, None
        # A gap of another slot (producer.slot_name changed since) is not this slot's to finish.
        return (gap, sequence) if gap.slot == self.slot else (None, None)

    def _refusal(self, state: SlotState, last_sequence: int, last_streamed: int | None) -> str:
        what = (f"was invalidated by the server ({state.invalidation})" if state.exists
                else "does not exist (dropped, or not on this server after a failover)")
        since = (f"{_lsn_text(last_streamed)} (the newest commit in the queue)" if last_streamed is not None
                 else _lsn_text(state.confirmed_flush_lsn) or "its last confirmed position (unknown)")
        jobs = ", ".join(naming.resync_job_name(t.schema_name, t.table_name) for t in self.tables)
        config = self.config_path or "siphon.yaml"
        return (
            f"replication slot {self.slot!r} of application {self.application_identifier} {what}, while its "
            f"stream {naming.stream_name(self.application_identifier)} already holds messages (last sequence "
            f"{last_sequence}): the changes committed since {since} can no longer be read and are missing from "
            "the queue. producer.on_slot_lost is 'stop', so nothing was changed. To go on, start the producer "
            f"once with `siphon-producer run --config {config} --accept-slot-loss`: it records the gap on "
            f"{self.subject}, creates a new slot and streams from its consistent point. Then every table must be "
            f"rebuilt: the Dagster sensor {naming.gap_sensor_name(self.application_identifier)} requests a resync "
            f"of each by itself (or run the jobs {jobs}, "
            "e.g. `dagster job execute -m siphon_dagster -j <job>`). Rebuild only after the new slot exists: "
            "a rebuild taken before it would miss the changes in between."
        )


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


def _lsn_text(lsn: int | None) -> str | None:
    return naming.format_lsn(lsn) if lsn is not None else None
