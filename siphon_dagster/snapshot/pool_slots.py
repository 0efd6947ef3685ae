"""A snapshot pool's limit set before its first runs queue, and more slots of it for one run, so a
run of many partitions reads several at once.

A pool caps the partitions of one target read at a time (each holds a replication slot and a
source connection while its COPY runs). Dagster gives a step one slot, so a run that snapshots a
range of partitions (a backfill from the UI, `siphon-dagster snapshot --partitions all`) would
read them one after another. The step asks the pool for more slots, as Dagster's own steps do, and
reads as many ranges at a time as it got: never more than the pool allows, never ahead of steps
already waiting for a slot. The slots are freed when the step ends; if its process dies, the
daemon frees every slot of the run, these included, once the run is marked ended.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

UNLIMITED_POOL_PARALLEL = 2  # ranges at a time when the pool has no limit (the instance's default)


@contextlib.contextmanager
def extra_slots(instance: Any, pool: str, run_id: str, step_key: str, wanted: int) -> Iterator[int]:
    """Claims up to `wanted` slots of `pool` beside the one the step holds; yields how many ranges
    the step may read at once (1 + the slots claimed)."""
    storage = instance.event_log_storage
    if wanted <= 0 or not getattr(storage, "supports_global_concurrency_limits", False):
        yield 1
        return
    info = storage.get_concurrency_info(pool)
    if info.limit is None:
        yield min(1 + wanted, UNLIMITED_POOL_PARALLEL)
        return
    claimed: list[str] = []
    try:
        if not info.pending_step_count:  # steps waiting for a slot go first
            for index in range(min(wanted, max(0, info.limit - info.active_slot_count))):
                key = f"{step_key}[range {index + 2}]"
                status = storage.claim_concurrency_slot(pool, run_id, key)
                if not status.is_claimed:
                    storage.free_concurrency_slot_for_step(run_id, key)  # leaves no pending entry
                    break
                claimed.append(key)
        yield 1 + len(claimed)
    finally:
        for key in claimed:
            storage.free_concurrency_slot_for_step(run_id, key)


def ensure_pool_limit(instance: Any, pool: str) -> None:
    """Gives `pool` the instance's default limit (`concurrency.pools.default_limit`) now, unless it
    has a limit already (set in the UI or by the CLI, kept as it is).

    Dagster's run queue gives a pool the default limit the first time it sees the pool's runs
    queued, and reads the limits it knows before that: on that pass the pool counts as unlimited,
    and every queued run of a load starts at once, each a process of a few hundred megabytes that
    waits in turn for a slot. Called before a tick's run requests are queued, it makes the first
    pass hold them in the queue."""
    storage = instance.event_log_storage
    if not getattr(storage, "supports_global_concurrency_limits", False):
        return
    if not instance.global_op_concurrency_default_limit or pool in storage.get_concurrency_keys():
        return
    storage.initialize_concurrency_limit_to_default(pool)
