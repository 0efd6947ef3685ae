"""`OpEvents`: a long-running op's asset events reach the event log at once, from any thread, and
the op keeps none of them in memory until it ends."""

from __future__ import annotations

import threading

import dagster as dg

from siphon_dagster.op_events import OpEvents
from tests.helpers.instance import instance_for_test

TABLES = [dg.AssetKey(["clickhouse", "public", f"t{index}"]) for index in range(4)]
EVENTS_PER_THREAD = 40


@dg.op
def report_from_threads(context) -> None:
    events = OpEvents(context)
    # One thread first: after each event, none is held (a streaming op held every one until it ended).
    held: list[bool] = []
    for sequence in range(EVENTS_PER_THREAD):
        events.log(dg.AssetMaterialization(asset_key=TABLES[0], metadata={"last_sequence": sequence}))
        held.append(context.has_events())

    def report(key: dg.AssetKey) -> None:
        for sequence in range(EVENTS_PER_THREAD):
            events.log(dg.AssetMaterialization(asset_key=key, metadata={"last_sequence": sequence}))
        events.log(dg.AssetObservation(asset_key=key, description="stream stopped: none"))

    # Then the other tables' threads at once, as a run's reporting thread, tick and op thread do.
    threads = [threading.Thread(target=report, args=(key,)) for key in TABLES[1:]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    events.log(dg.AssetObservation(asset_key=TABLES[0], description="stream stopped: none"))
    context.log.info(f"events still held: {sum(held)} of {len(held)} checks; now {context.has_events()}")


@dg.job
def reporting_job() -> None:
    report_from_threads()


def test_every_event_reaches_the_event_log_and_none_is_held_until_the_op_ends():
    with instance_for_test() as instance:
        result = reporting_job.execute_in_process(instance=instance)
        assert result.success
        [line] = [entry.user_message for entry in instance.all_logs(result.run_id)
                  if entry.user_message.startswith("events still held")]
        assert line == f"events still held: 0 of {EVENTS_PER_THREAD} checks; now False"
        for key in TABLES:
            materializations = instance.fetch_materializations(key, limit=100).records
            sequences = sorted(record.asset_materialization.metadata["last_sequence"].value
                               for record in materializations)
            assert sequences == list(range(EVENTS_PER_THREAD))
            assert all(record.run_id == result.run_id for record in materializations)
            [observation] = instance.fetch_observations(key, limit=10).records
            assert observation.asset_observation.description == "stream stopped: none"
        # Nothing was left to hand on when the op returned.
        assert not [event for event in result.all_events if event.is_step_materialization]
