"""The per-table error strategies of a streaming run (`TableConfig.on_error`), on a fake applier."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from siphon_core.wire.packages import encode_package
from siphon_dagster.streaming.apply import AppliedBatch
from siphon_dagster.streaming.batch import PackageAssembler, ReceivedPackage
from siphon_dagster.streaming.schema import IncompatibleSchemaError, table_schema
from siphon_dagster.streaming.strategy import ErrorStrategy, RetryPolicy, StreamApplyError
from siphon_dagster.streaming.toast import ToastStats
from tests.unit.test_streaming_packages import NOTES, MemoryTarget, insert, package

QUICK = RetryPolicy(attempts=3, initial_wait_seconds=0.01, max_wait_seconds=0.02)


@dataclass
class FlakyApplier:
    failures: int
    error: Exception
    calls: int = 0
    qualified_name: str = "public.notes"
    target: MemoryTarget = field(default_factory=MemoryTarget)

    def apply(self, packages: Sequence[ReceivedPackage], prepared: object = None) -> AppliedBatch:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return AppliedBatch(table_schema("public", "notes", NOTES), len(packages), None, ToastStats())


def received() -> list[ReceivedPackage]:
    assembler = PackageAssembler()
    return [assembler.accept(40 + i, encode_package(package([insert(0x500 + i, str(i), "a", "1")])))  # type: ignore[misc]
            for i in range(2)]


def run(mode: str, applier: FlakyApplier) -> tuple[AppliedBatch | None, list[int]]:
    strategy = ErrorStrategy(mode, None, applier, QUICK, "siphon_dead_letter.test.public.notes", "durable")  # type: ignore[arg-type]
    return asyncio.run(strategy.apply(received(), {}))


def test_retry_succeeds_within_its_attempts() -> None:
    applier = FlakyApplier(failures=2, error=RuntimeError("target unavailable"))
    applied, rejected = run("retry", applier)
    assert applied is not None and applied.rows == 2 and rejected == []
    assert applier.calls == 3


def test_retry_then_stop_names_table_sequences_lsns_and_attempts() -> None:
    with pytest.raises(StreamApplyError) as raised:
        run("retry", FlakyApplier(failures=9, error=RuntimeError("target unavailable")))
    assert str(raised.value).startswith(
        "table public.notes (target memory): cannot apply stream sequences 40-41 (commit LSN 0/500 to 0/501) "
        "after 3 attempts: RuntimeError: target unavailable.")
    assert (raised.value.first_sequence, raised.value.last_sequence) == (40, 41)


def test_stop_does_not_retry() -> None:
    applier = FlakyApplier(failures=1, error=RuntimeError("target unavailable"))
    with pytest.raises(StreamApplyError, match="sequences 40-41 .*: RuntimeError: target unavailable"):
        run("stop", applier)
    assert applier.calls == 1


@pytest.mark.parametrize("mode", ["stop", "retry", "dead_letter"])
def test_a_schema_the_target_cannot_follow_always_stops(mode: str) -> None:
    applier = FlakyApplier(failures=9, error=IncompatibleSchemaError("table public.notes: score ..."))
    with pytest.raises(IncompatibleSchemaError):
        run(mode, applier)
    assert applier.calls == 1


def test_dead_letter_moves_nothing_aside_while_the_target_does_not_answer() -> None:
    """Every package of a batch fails alone while the target is down: that is no bad package, so the
    table stops with the batch unacknowledged instead of moving it to the dead-letter subject (the
    strategy has no queue here: a dead letter would fail on it)."""
    applier = FlakyApplier(failures=9, error=ConnectionRefusedError("connection refused"))
    applier.target.down = True
    with pytest.raises(StreamApplyError, match=r"sequences 40-41 .*the target does not answer: "
                                               r"ConnectionRefusedError: target unavailable; nothing is moved"):
        run("dead_letter", applier)
    assert applier.calls == 2  # the batch, then its first package alone
