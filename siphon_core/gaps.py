"""Gap records: what the producer writes to the queue when its replication slot was lost.

A lost slot (dropped, or invalidated by the server) means the changes committed between its last
confirmed position and a new slot's consistent point were never read: no package will ever carry
them. The producer records that on the application's gap subject (`naming.gap_subject`) in two
steps, both acknowledged before it goes on:

- `lost`: the loss was noticed, before anything was changed at the source;
- `resumed`: a new slot exists; every change committed after its consistent point reaches the queue.

A `lost` record without a `resumed` one after it is a gap the producer must still finish (see
`producer_service.slot_loss`). The Dagster side rebuilds every table on `resumed` records: a
rebuild's snapshots are taken after the new slot exists, so together with the stream after the
consistent point they hold every change.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Literal

LOST = "lost"
RESUMED = "resumed"

Stage = Literal["lost", "resumed"]
Reason = Literal["missing", "invalidated"]


class GapRecordError(ValueError):
    """A message on the gap subject that is not a gap record."""


@dataclass(frozen=True)
class SlotGap:
    application_identifier: str
    slot: str
    stage: Stage
    reason: Reason
    recorded_at: str  # ISO 8601, UTC
    # What the server said about an invalidated slot (wal_status, invalidation_reason), if anything.
    detail: str | None = None
    # The lost slot's confirmed position (PostgreSQL's X/X text) when the server still showed it.
    last_confirmed_lsn: str | None = None
    # The newest commit the queue held when the loss was noticed: with the consistent point, the
    # narrowest bounds of the lost changes (the queue holds what the old slot read past its last
    # confirmed position, too).
    last_streamed_lsn: str | None = None
    # The new slot's consistent point: `resumed` records only.
    consistent_point: str | None = None
    # The stream sequence of the `lost` record a `resumed` record ends.
    lost_sequence: int | None = None

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> SlotGap:
        try:
            fields = json.loads(data)
            gap = cls(**fields)
        except (ValueError, TypeError) as error:
            raise GapRecordError(f"{where} is not a gap record: {error}") from None
        if gap.stage not in (LOST, RESUMED) or gap.reason not in ("missing", "invalidated"):
            raise GapRecordError(f"{where}: unknown stage {gap.stage!r} or reason {gap.reason!r}")
        if gap.stage == RESUMED and gap.consistent_point is None:
            raise GapRecordError(f"{where}: a resumed gap record without the new slot's consistent point")
        return gap

    def message_id(self) -> str:
        """Deterministic, so a retried publish is dropped by JetStream's duplicate window."""
        if self.stage == LOST:
            return f"gap:{self.slot}:lost:{self.last_confirmed_lsn or 'unknown'}:{self.recorded_at}"
        return f"gap:{self.slot}:resumed:{self.consistent_point}"
