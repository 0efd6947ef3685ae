"""`OpEvents`: the events of an op that runs for days, written at once and not kept in memory.

`OpExecutionContext.log_event` writes an event to the run's event log at once, and also keeps it in
a list that Dagster hands on only when the op's compute function yields or returns. A streaming op
does neither while it runs: every materialization and observation it logged stayed in that list
until the run ended, about 3 KiB each. At one materialization per table a minute, a run of 200
tables kept 35 MB more every hour; a single-table run, one per batch. The list is emptied after
each event here: what it holds is in the event log already, and nothing else reads it.
"""

from __future__ import annotations

import threading

import dagster as dg


class OpEvents:
    """Logs an op's asset events from any of its threads; none is kept for the op's end."""

    def __init__(self, context: dg.OpExecutionContext) -> None:
        self._context = context
        # The reporting thread, the tick and the op's own thread log events: the list is swapped
        # out under the same lock an event is added under, so none is handed on twice.
        self._lock = threading.Lock()

    def log(self, event: dg.AssetMaterialization | dg.AssetObservation) -> None:
        with self._lock:
            self._context.log_event(event)
            for _ in self._context.consume_events():  # in the event log already
                pass
