"""`<group>_slot_gaps`: a replication slot the producer lost rebuilds every table.

The producer records a lost slot on the application's gap subject (`siphon_core.gaps`). For each
new `resumed` record (a new slot exists; changes after its consistent point are in the queue, the
ones before it since the lost slot's last position are not), the sensor records an observation on
every target asset, so the asset's history shows the gap, and requests a resync of every table (a
run of `<group>_resync` each): a resync's snapshots are taken after the new slot existed, so with
the stream they hold every change again.

The cursor is the last stream sequence handled. A sensor without a cursor (a new instance, or a
reset) starts after the newest gap the instance already observed on a target asset, so an old gap
is never rebuilt again; run keys make a repeated request a no-op as well.
"""

from __future__ import annotations

import asyncio

import dagster as dg

from siphon_core import naming
from siphon_core.gaps import LOST, RESUMED, GapRecordError, SlotGap
from siphon_dagster.resources import NatsResource
from siphon_dagster.resync_requests import ResyncRequests
from siphon_dagster.specs import TableSpec

GAP_TAG = "siphon/gap"
SEQUENCE_KEY = "gap_sequence"
_OBSERVATIONS_SCANNED = 20


def gap_observations(specs: list[TableSpec], sequence: int, gap: SlotGap,
                     resyncs: ResyncRequests) -> list[dg.AssetObservation]:
    """One observation per target asset: what was lost and what is being done about it."""
    since = gap.last_streamed_lsn or gap.last_confirmed_lsn or "the lost slot's last confirmed position (unknown)"
    observations = []
    for spec in specs:
        job = resyncs.describe(spec)
        for target in spec.targets:
            observations.append(dg.AssetObservation(
                asset_key=spec.target_key(target),
                description=(f"replication slot {gap.slot} was {gap.reason}: changes committed after {since} and "
                             f"before {gap.consistent_point} never reached the queue; {job} requested to rebuild "
                             "the table"),
                metadata={
                    SEQUENCE_KEY: sequence,
                    "gap_lsn": gap.consistent_point or "",
                    "reason": gap.reason,
                    "detail": gap.detail or "",
                    "slot": gap.slot,
                    "last_confirmed_lsn": gap.last_confirmed_lsn or "unknown",
                    "last_streamed_lsn": gap.last_streamed_lsn or "unknown",
                    "recorded_at": gap.recorded_at,
                    "action": f"resync requested: {job}",
                },
            ))
    return observations


def resync_requests(specs: list[TableSpec], sequence: int, resyncs: ResyncRequests) -> list[dg.RunRequest]:
    return [resyncs.request(spec, run_key=f"slot-gap-{sequence}-{spec.resync_job_name}", tags={GAP_TAG: str(sequence)})
            for spec in specs]


def observed_gap_sequence(instance: dg.DagsterInstance, specs: list[TableSpec]) -> int:
    """The newest gap this instance recorded on any target asset (0: none)."""
    newest = 0
    for spec in specs:
        for target in spec.targets:
            result = instance.fetch_observations(spec.target_key(target), limit=_OBSERVATIONS_SCANNED)
            for record in result.records:
                observation = record.asset_observation
                value = observation.metadata.get(SEQUENCE_KEY) if observation is not None else None
                if value is not None:
                    newest = max(newest, int(value.value))
    return newest


def read_gap_records(resource: NatsResource, after: int) -> list[tuple[int, bytes]]:
    async def fetch() -> list[tuple[int, bytes]]:
        queue = resource.queue(client_name="siphon gap sensor")
        await queue.connect(connect_timeout=2.0)
        try:
            if await queue.last_sequence() is None:
                return []  # the producer never started
            return await queue.messages_after(naming.gap_subject(resource.application_identifier), after)
        finally:
            await queue.close()

    return asyncio.run(asyncio.wait_for(fetch(), timeout=20.0))


def build_gap_sensor(specs: list[TableSpec], group: str, resyncs: ResyncRequests | None = None) -> dg.SensorDefinition:
    """`resyncs`: how a table's rebuild is requested. Until it covers every table, a gap is left
    for a later tick (the cursor stays before it) rather than half handled."""

    @dg.sensor(
        name=f"{group}_slot_gaps",
        jobs=[resyncs.job] if resyncs is not None else None,
        minimum_interval_seconds=30,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Reads the gaps the producer records when its replication slot was lost, records each on "
                    "every target asset and requests a resync of every table. The cursor is the last stream "
                    "sequence handled.",
    )
    def _slot_gaps(context: dg.SensorEvaluationContext, queue: NatsResource) -> dg.SensorResult | dg.SkipReason:
        after = int(context.cursor) if context.cursor else observed_gap_sequence(context.instance, specs)
        try:
            records = read_gap_records(queue, after)
        except Exception as error:  # an unreachable queue holds the gaps back, never loses them
            context.log.warning(f"could not read gap records from the queue: {error!r}")
            return dg.SkipReason(f"queue unreachable: {error!r}")
        if not records:
            # Kept, so that the next tick reads from here instead of scanning every asset's observations.
            context.update_cursor(str(after))
            return dg.SkipReason(f"no gap recorded after stream sequence {after}")
        resumed: list[tuple[int, SlotGap]] = []
        lost: dict[int, SlotGap] = {}
        for sequence, data in records:
            try:
                gap = SlotGap.from_json(data, f"stream message {sequence}")
            except GapRecordError as error:
                context.log.error(str(error))
                continue
            if gap.stage == RESUMED:
                resumed.append((sequence, gap))
                lost.pop(gap.lost_sequence or 0, None)
            elif gap.stage == LOST:
                lost[sequence] = gap
        for sequence, gap in lost.items():
            context.log.warning(f"the producer recorded slot {gap.slot} as {gap.reason} (stream message {sequence}) "
                                "and has not recorded its new slot yet; the tables are rebuilt once it has")
        run_requests: list[dg.RunRequest] = []
        observations: list[dg.AssetObservation] = []
        if resumed:
            missing = [spec.qualified_name for spec in specs if resyncs is None or not resyncs.covers(spec)]
            if missing or resyncs is None:
                message = (f"slot gap at stream message {resumed[0][0]} waits: no resync job for "
                           f"{', '.join(missing)} in this code location")
                context.log.error(message)
                return dg.SkipReason(message)
            for sequence, gap in resumed:
                context.log.warning(f"replication slot {gap.slot} was {gap.reason}; rebuilding every table (gap "
                                    f"recorded at stream message {sequence}, new slot from {gap.consistent_point})")
                observations.extend(gap_observations(specs, sequence, gap, resyncs))
            # One rebuild after the newest gap covers the older ones too.
            run_requests = resync_requests(specs, resumed[-1][0], resyncs)
        return dg.SensorResult(run_requests=run_requests, asset_events=observations, cursor=str(records[-1][0]))

    return _slot_gaps
