"""What a streaming run reports after each micro-batch and at its end."""

from __future__ import annotations

from dataclasses import dataclass, field

from siphon_core import naming


@dataclass(frozen=True)
class BatchReport:
    target: str
    table: str  # schema.table
    first_sequence: int  # stream sequences of the batch's messages
    last_sequence: int
    messages: int
    events: int
    rows_by_operation: dict[str, int]  # events of the batch by operation, before the fold
    rows_applied: int  # rows handed to the target after the fold (with superseded ones, where it allows them)
    applied_lsn: int  # greatest commit LSN applied (0 when the batch applied nothing)
    latency_seconds: float  # first message pulled -> batch acknowledged
    lag_oldest_seconds: float  # now - oldest commit time in the batch
    lag_newest_seconds: float  # now - newest commit time in the batch
    pending: int  # messages of this consumer still to apply after the batch
    dead_lettered: tuple[int, ...] = ()  # stream sequences moved to the dead-letter subject
    unchanged_values_filled: int = 0  # unchanged TOASTed values filled (batch, target or source)
    seconds: dict[str, float] = field(default_factory=dict)  # pull, schema, spark, toast, apply, ack
    # What an operator must act on, e.g. rows that predate an added column need a resync.
    warnings: tuple[str, ...] = ()
    prepared_early: bool = False  # decoded and folded while the batch before was written
    load_path: str | None = None  # how the target loaded the batch, when it says (Snowflake: stage or insert)
    schema_changed: bool = False  # the target's table schema differs from the previous batch's
    decoded_in_driver: bool = False  # small batch: decoded in the run's process, not by Spark tasks
    # The target had no table and this batch made it: whatever it held before is not there.
    created_table: bool = False
    gathered: str | None = None  # how a group run's batch gathered its messages (pace.GATHERED_*)

    @property
    def applied_lsn_text(self) -> str:
        return naming.format_lsn(self.applied_lsn)


@dataclass
class RunSummary:
    batches: int = 0
    events: int = 0
    rows_applied: int = 0
    applied_lsn: int = 0
    dead_lettered: list[int] = field(default_factory=list)

    def add(self, report: BatchReport) -> None:
        self.batches += 1
        self.events += report.events
        self.rows_applied += report.rows_applied
        self.applied_lsn = max(self.applied_lsn, report.applied_lsn)
        self.dead_lettered += report.dead_lettered
