"""What the snapshot sensor asks for one (target, table) at one tick: a pure decision on what the
instance knows of the table's partitions, so that each rule is tested without any service.

Two rules, nothing else:
- a load snapshots every partition of a table that has none materialized (new to the
  configuration) or whose target table is missing (dropped), and then every partition added while
  it runs, once each;
- a partition whose latest snapshot run failed (any run, one partition or a range) is run again
  after a wait that doubles, until it has been tried `max_attempts` times; then it waits for an
  operator, and its state says so.

The sensor's cursor keeps, per (target, table), only the load in progress and the failed
partitions' attempts: which partitions are materialized, failed or running is Dagster's own record
(`DagsterInstance.get_status_by_partition`), which counts every run of the asset, tagged or not.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

MATERIALIZED = "materialized"
FAILED = "failed"
IN_PROGRESS = "in_progress"
# A run of the load in progress whose partition is still to be written (queued or running).
RUN_ACTIVE = "active"
RUN_ENDED = "ended"
MAX_RETRY_DELAY_SECONDS = 600.0


def retry_delay(attempts: int, first_delay: float) -> float:
    """The wait after the `attempts`-th failed run of a partition: doubling, capped at 10 minutes."""
    return min(MAX_RETRY_DELAY_SECONDS, first_delay * 2 ** (attempts - 1))


@dataclass(frozen=True)
class Retry:
    key: str
    attempt: int  # the attempt this run is, the failed first run counted as 1
    since: float  # when the partition was first seen failed: names the series of attempts


@dataclass
class Plan:
    load: list[str] = field(default_factory=list)  # partitions requested as part of a load
    retries: list[Retry] = field(default_factory=list)
    load_started: bool = False
    drop_deferred: bool = False  # a drop to act on once the target answers
    reload: bool = False  # `load` holds partitions a drop took away
    entry: dict[str, Any] = field(default_factory=dict)  # the (target, table)'s new cursor entry


@dataclass(frozen=True)
class Partitions:
    """A table's partitions, each in exactly one state."""

    keys: tuple[str, ...]
    materialized: frozenset[str]
    failed: frozenset[str]
    in_progress: frozenset[str]

    @property
    def never(self) -> frozenset[str]:
        return frozenset(self.keys) - self.materialized - self.failed - self.in_progress

    @classmethod
    def of(cls, keys: Sequence[str], status: Mapping[str, str | None],
           load_runs: Mapping[str, str]) -> Partitions:
        """`status` is Dagster's per-partition status; a run of the load that is queued counts as
        in progress even before Dagster planned its partition."""
        in_progress = {k for k in keys if status.get(k) == IN_PROGRESS or load_runs.get(k) == RUN_ACTIVE}
        failed = {k for k in keys if status.get(k) == FAILED} - in_progress
        materialized = {k for k in keys if status.get(k) == MATERIALIZED} - in_progress - failed
        return cls(tuple(keys), frozenset(materialized), frozenset(failed), frozenset(in_progress))


def plan_table(partitions: Partitions, entry: Mapping[str, Any], *, load_runs: Mapping[str, str],
               table_missing: Callable[[], bool | None], now: float, auto_load: bool, max_attempts: int,
               first_retry_delay: float, table_check_seconds: float = 0.0,
               lost: Collection[str] = ()) -> Plan:
    """The requests for one (target, table) and its next cursor entry.

    `load_runs` maps each partition that a run of the current load covers to RUN_ACTIVE or
    RUN_ENDED. `table_missing()` asks the target whether the table is absent: None when the
    target cannot be reached, and then nothing is requested (the run would only fail, spending an
    attempt); it is asked only when the answer matters, and a loaded table's presence at most
    every `table_check_seconds` (each question is a query at the target). `lost` names the partitions
    whose rows a drop of the table at the target took away since the last tick: not materialized
    since an operator dropped it (`siphon-dagster target drop`) or since a streaming run found it
    missing there and made it. They are loaded again, failures forgotten, unless running;
    partitions materialized after the drop are at the target, and a load in progress goes on with
    the lost partitions added to it.
    """
    plan = Plan()
    reachable: list[bool | None] = []

    def missing() -> bool | None:
        if not reachable:
            reachable.append(table_missing())
        return reachable[0]

    def can_request() -> bool:
        return missing() is not None

    plan.entry["failed"] = _retries(partitions, entry.get("failed", {}), plan, can_request, now=now,
                                    max_attempts=max_attempts, first_delay=first_retry_delay)
    load = entry.get("load")
    checked_at = entry.get("checked_at", 0.0)
    # A stream may have made the table again already: the drop, not the target, is the signal.
    taken = sorted(k for k in lost if k in partitions.keys and k not in partitions.in_progress) if auto_load else []
    if taken and not can_request():
        plan.drop_deferred = True
    elif taken:
        if load is None:
            load = {"at": now}
            plan.load_started = True
        plan.load, plan.reload = taken, True
        plan.retries = [retry for retry in plan.retries if retry.key not in taken]
        plan.entry["failed"] = {k: r for k, r in plan.entry["failed"].items() if k not in taken}
    elif load is None:
        quiet = not partitions.in_progress and not partitions.failed and partitions.keys
        new = not partitions.materialized
        due = now - checked_at >= table_check_seconds
        if auto_load and quiet and not new and due:
            checked_at = now
        if auto_load and quiet and (new or (due and missing())) and can_request():
            load = {"at": now}
            plan.load = list(partitions.keys)
            plan.load_started = True
    else:
        unrequested = sorted(k for k in partitions.never if k not in load_runs)
        if unrequested and can_request():
            plan.load = unrequested
        elif not partitions.in_progress and not unrequested:
            load = None  # every partition of the load ran: what failed is retried as a failure
    if load is not None:
        plan.entry["load"] = load
    if checked_at:
        plan.entry["checked_at"] = checked_at
    if not plan.entry["failed"]:
        del plan.entry["failed"]
    return plan


def _retries(partitions: Partitions, records: Mapping[str, dict[str, Any]], plan: Plan,
             can_request: Callable[[], bool], *, now: float, max_attempts: int,
             first_delay: float) -> dict[str, dict[str, Any]]:
    """Failed partitions' records (`attempts`, `since`, `retry_at`; `retry_at` is None while a
    retry is on its way) and the retries due now."""
    kept: dict[str, dict[str, Any]] = {}
    for key in partitions.keys:
        record = records.get(key)
        if key in partitions.in_progress:
            if record is not None:
                kept[key] = record
            continue
        if key not in partitions.failed:
            continue  # materialized since, or its run is gone: nothing to retry
        if record is None:
            record = {"attempts": 1, "since": now, "retry_at": now + retry_delay(1, first_delay)}
        elif record.get("retry_at") is None:  # the retry requested earlier failed too
            record = {**record, "retry_at": now + retry_delay(record["attempts"], first_delay)}
        if record["attempts"] < max_attempts and now >= record["retry_at"] and can_request():
            plan.retries.append(Retry(key, record["attempts"] + 1, record["since"]))
            record = {**record, "attempts": record["attempts"] + 1, "retry_at": None}
        kept[key] = record
    return kept


def exhausted(entry: Mapping[str, Any], max_attempts: int) -> dict[str, int]:
    """Failed partitions that will not be tried again, with their attempts."""
    return {key: record["attempts"] for key, record in entry.get("failed", {}).items()
            if record["attempts"] >= max_attempts and record.get("retry_at") is not None}
