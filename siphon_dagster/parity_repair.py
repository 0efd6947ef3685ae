"""A repair fed by row parity: the partitions and keys it names, repaired, then the table's checks again.

Row parity's divergent-row finder names each divergent key with its kind and, for a key the source
has, the block-range partition holding it. Those partitions are snapshotted again (nothing else of
the table is), and the keys the source did not have (extra at the target) go through `repair_keys`,
which reads their absence under a temporary slot's snapshot and tombstones them at that exact
version (a key inserted at the source since is re-snapshotted with its partition instead). Keys
still changing after every re-read are left to the stream, which is applying them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import dagster as dg

from siphon_core import naming
from siphon_core.config import SiphonConfig
from siphon_core.queue import JetStreamQueue
from siphon_dagster import runs
from siphon_dagster.checks.digest import EXTRA, ParityReport
from siphon_dagster.checks.row_parity import find_divergent_rows
from siphon_dagster.checks.stream_position import StreamWatch
from siphon_dagster.repair import RepairSummary, repair_keys
from siphon_dagster.specs import TableSpec
from siphon_dagster.targets import build_target


@dataclass
class ParityRepair:
    """What row parity named at one target and what was done about it."""

    table: str
    target: str
    report: ParityReport
    partitions: list[str] = field(default_factory=list)  # re-snapshotted: exactly those row parity named
    snapshot_runs: list[runs.RunOutcome] = field(default_factory=list)
    extra: RepairSummary | None = None  # the keys the source did not have

    @property
    def success(self) -> bool:
        return all(run.success for run in self.snapshot_runs) and (self.extra is None or self.extra.success)

    def lines(self) -> list[str]:
        report = self.report
        kinds: dict[str, int] = {}
        for key in report.divergent:
            kinds[key.kind] = kinds.get(key.kind, 0) + 1
        found = ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items())) or "none"
        lines = [f"{self.table} at {self.target}: row parity found {len(report.divergent)} divergent keys ({found}) "
                 f"in {report.mismatched_buckets} of {report.buckets} buckets"
                 + (f"; {len(report.in_flight)} keys still changing, left to the stream" if report.in_flight else "")]
        for run in self.snapshot_runs:
            lines.append(f"{self.table} at {self.target}, partitions {run.first_partition}...{run.last_partition}: "
                         f"{'re-snapshotted' if run.success else 'FAILED'} (run {run.run_id})")
        if self.extra is not None:
            lines.append(self.extra.text())
        if not report.divergent:
            lines.append(f"{self.table} at {self.target}: nothing to repair")
        return lines


def stream_watch(config: SiphonConfig, spec: TableSpec, target: str) -> StreamWatch:
    """What the checks watch for (target, table): the producer's slot and the target's consumer."""
    application = config.application_identifier
    return StreamWatch(
        source_dsn=config.source.conninfo(), slot=config.producer.slot_name or naming.slot_name(application),
        subject=naming.table_subject(application, spec.schema, spec.name),
        consumer=naming.consumer_name(target, spec.schema, spec.name),
        make_queue=lambda: JetStreamQueue.from_config(config.queue, application,
                                                      name=f"siphon repair {spec.qualified_name}"))


def repair_divergent_rows(config: SiphonConfig, spec: TableSpec, target: str, instance: dg.DagsterInstance,
                          log: Callable[[str], None] = lambda _: None) -> ParityRepair:
    """Runs row parity for `spec`'s table at `target`, re-snapshots the partitions it named (runs of
    the target asset recorded by `instance`) and tombstones the keys the source does not have.

    Raises row_parity.StreamBehind when the stream does not apply the source's read in time
    (checks.settle_timeout_seconds): nothing can be told apart from changes in flight then."""
    runs.choose_targets(spec, target)
    destination = build_target(target, config)
    try:
        report = find_divergent_rows(spec, destination, config.source.conninfo(), stream_watch(config, spec, target),
                                     config.checks, log)
    finally:
        destination.close()
    repair = ParityRepair(spec.qualified_name, target, report)
    extra = [key.key for key in report.divergent if key.kind == EXTRA]
    if extra:
        repair.extra = repair_keys(config, spec, target, extra, instance)
    repair.partitions = report.partitions
    if repair.partitions:
        runs.refresh_partitions(instance, config, [spec])
        spans = runs.contiguous_spans(instance, spec, repair.partitions)
        repair.snapshot_runs = runs.snapshot(config, spec, target, spans, instance)
    return repair
