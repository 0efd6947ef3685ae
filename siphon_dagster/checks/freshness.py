"""Freshness: how old the oldest change is that JetStream holds for the table and the target has not applied.

A table with nothing pending at its consumer is fresh. The latest streaming batch's applied LSN and lag
(recorded on the asset by the streaming runs) are added as context.
"""

from __future__ import annotations

import asyncio
import time

from siphon_core import queue
from siphon_dagster.checks.outcome import WARN, CheckContext, Outcome

NAME = "freshness"
SEVERITY = WARN
DESCRIPTION = ("Warns when the oldest change stored in JetStream for this table and not yet applied at the "
               "target is older than checks.freshness_warn_seconds.")


async def _pending(context: CheckContext) -> tuple[queue.ConsumerPosition | None, float | None]:
    jetstream = context.watch.make_queue()  # type: ignore[operator]
    await queue.connect_within(jetstream)
    try:
        position = await queue.consumer_position(jetstream, context.watch.consumer)
        if position is None or position.pending == 0:
            return position, None
        return position, await queue.oldest_after(jetstream, context.watch.subject, position.ack_floor)
    finally:
        await jetstream.close()


def _last_batch(context: CheckContext) -> dict:
    if context.instance is None:
        return {}
    event = context.instance.get_latest_materialization_event(context.asset_key)
    materialization = event.asset_materialization if event is not None else None
    if materialization is None:
        return {}
    metadata = materialization.metadata
    found = {name: metadata[name].value for name in ("applied_lsn", "lag_seconds") if name in metadata}
    return {f"last_batch_{name}": value for name, value in found.items()}


def check(context: CheckContext) -> Outcome:
    position, oldest = asyncio.run(_pending(context))
    metadata = _last_batch(context)
    limit = context.settings.freshness_warn_seconds
    if position is None:
        return Outcome(False, f"never streamed to {context.target.name}: consumer {context.watch.consumer} does not "
                              "exist (is the streaming sensor running?)", metadata, WARN)
    metadata.update({"pending_messages": position.pending, "acked_stream_sequence": position.ack_floor})
    if position.pending == 0 or oldest is None:
        return Outcome(True, "nothing pending", metadata, WARN)
    age = max(0.0, time.time() - oldest)
    metadata["oldest_pending_age_seconds"] = round(age, 3)
    if age > limit:
        return Outcome(False, f"{position.pending} messages pending, the oldest stored {age:.0f}s ago (limit "
                              f"{limit:.0f}s)", metadata, WARN)
    return Outcome(True, f"{position.pending} messages pending, the oldest stored {age:.1f}s ago", metadata, WARN)
