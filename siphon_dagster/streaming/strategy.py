"""What a streaming run does with a batch it cannot apply: `TableConfig.on_error`.

- stop: raise `StreamApplyError` naming the table, stream sequences and LSNs; nothing is acked, so
  the next run replays the same messages.
- retry: retry the batch with exponential backoff (tenacity), then stop as above.
- dead_letter: find the packages that fail alone (the batch is retried one package at a time),
  publish each raw message to the table's dead-letter subject, ack it, record it, go on. A package
  fails alone only while the target answers: when it does not, the table stops as under stop,
  since a target that is down would otherwise move every package aside.
A schema change the target cannot follow always stops: skipping it would lose every later row.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from nats.aio.msg import Msg
from pyspark.errors import PythonException
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from siphon_core import naming
from siphon_core.logs import get_logger
from siphon_core.queue import JetStreamQueue
from siphon_dagster.streaming.apply import AppliedBatch, BatchApplier, PreparedBatch
from siphon_dagster.streaming.batch import ReceivedPackage
from siphon_dagster.streaming.schema import SchemaChangeError
from siphon_dagster.streaming.toast import ToastStats

_log = get_logger("streaming.strategy")


class StreamApplyError(RuntimeError):
    """A batch could not be applied and the table's strategy says stop."""

    def __init__(self, message: str, table: str, first_sequence: int, last_sequence: int) -> None:
        super().__init__(message)
        self.table = table
        self.first_sequence = first_sequence
        self.last_sequence = last_sequence


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5
    initial_wait_seconds: float = 0.5
    max_wait_seconds: float = 30.0


class ErrorStrategy:
    def __init__(self, mode: str, queue: JetStreamQueue, applier: BatchApplier, retry: RetryPolicy,
                 dead_letter_subject: str, durable: str) -> None:
        self.mode = mode
        self.queue = queue
        self.applier = applier
        self.retry = retry
        self.dead_letter_subject = dead_letter_subject
        self.durable = durable
        # How a retry waits: a group run's consumer gives its turn back meanwhile.
        self.sleep: Callable[[float], Awaitable[None]] = asyncio.sleep

    async def apply(self, packages: Sequence[ReceivedPackage], messages: dict[int, Msg],
                    early: Awaitable[PreparedBatch | None] | None = None) -> tuple[AppliedBatch | None, list[int]]:
        """Applies the batch; returns what was applied and the stream sequences dead-lettered.

        `early` is the batch's preparation started beforehand; when it failed, the first attempt
        prepares again and its error is handled like any other."""
        prepared = await _settled(early)
        if self.mode == "retry":
            return await self._with_retries(packages, prepared), []
        try:
            return await asyncio.to_thread(self.applier.apply, packages, prepared), []
        except SchemaChangeError:
            raise
        except Exception as error:
            if self.mode != "dead_letter":
                raise self._stop_error(packages, error) from error
            _log.warning("batch failed; applying its packages one at a time to isolate the failing ones",
                         table=self.applier.qualified_name, error=_one_line(error))
        return await self._isolate(packages, messages)

    async def undecodable(self, message: Msg, sequence: int, error: Exception) -> None:
        """A message that is not a package never becomes one: dead-letter it or stop, never retry."""
        if self.mode != "dead_letter":
            raise StreamApplyError(
                f"table {self.applier.qualified_name} (target {self.applier.target.name}): stream sequence "
                f"{sequence} is not a Siphon package ({error}); it stays unacknowledged. Set on_error: "
                "dead_letter for this table to move it aside", self.applier.qualified_name, sequence, sequence)
        await self._dead_letter(message, sequence, error)

    async def _with_retries(self, packages: Sequence[ReceivedPackage], prepared: PreparedBatch | None) -> AppliedBatch:
        policy = self.retry
        retrying = AsyncRetrying(
            stop=stop_after_attempt(policy.attempts),
            wait=wait_exponential(multiplier=policy.initial_wait_seconds, max=policy.max_wait_seconds),
            retry=retry_if_exception(lambda error: not isinstance(error, SchemaChangeError)),
            sleep=self.sleep,
            before_sleep=lambda state: _log.warning(
                "batch failed; retrying", table=self.applier.qualified_name, attempt=state.attempt_number,
                error=_one_line(state.outcome.exception()) if state.outcome else ""),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    # Only the first attempt uses the early preparation; a retry starts over.
                    first, prepared = prepared, None
                    return await asyncio.to_thread(self.applier.apply, packages, first)
        except SchemaChangeError:
            raise
        except Exception as error:
            raise self._stop_error(packages, error, f" after {policy.attempts} attempts") from error
        raise AssertionError("unreachable: tenacity either returns or raises")

    async def _isolate(self, packages: Sequence[ReceivedPackage],
                       messages: dict[int, Msg]) -> tuple[AppliedBatch | None, list[int]]:
        applied: list[AppliedBatch] = []
        rejected: list[int] = []
        for package in packages:
            try:
                applied.append(await asyncio.to_thread(self.applier.apply, [package]))
            except SchemaChangeError:
                raise
            except Exception as error:
                unanswered = await asyncio.to_thread(self._unanswered)
                if unanswered is not None:
                    raise self._stop_error(
                        packages, error, f" (the target does not answer: {unanswered}; nothing is moved to the "
                        "dead-letter subject while it is down)") from error
                for sequence in package.sequences:
                    await self._dead_letter(messages[sequence], sequence, error)
                rejected += package.sequences
        return _combine(applied), rejected

    def _unanswered(self) -> str | None:
        """Why the target does not answer a trivial statement; None when it does."""
        try:
            self.applier.target.ping()
        except Exception as error:
            return f"{type(error).__name__}: {_one_line(error)}"[:500]
        return None

    async def _dead_letter(self, message: Msg, sequence: int, error: Exception) -> None:
        headers = {
            # Deterministic id: a dead letter published again after a crash is dropped as a duplicate.
            "Nats-Msg-Id": f"dead-letter:{self.durable}:{sequence}",
            "Siphon-Consumer": self.durable,
            "Siphon-Stream-Sequence": str(sequence),
            "Siphon-Subject": message.subject,
            "Siphon-Error": _one_line(error)[:2000],
        }
        await self.queue.js.publish(self.dead_letter_subject, message.data, headers=headers,
                                    stream=self.queue.settings.stream)
        await message.ack_sync()
        _log.error("message moved to the dead-letter subject", table=self.applier.qualified_name,
                   sequence=sequence, subject=self.dead_letter_subject, error=_one_line(error))

    def _stop_error(self, packages: Sequence[ReceivedPackage], error: BaseException,
                    attempts: str = "") -> StreamApplyError:
        first = min(s for p in packages for s in p.sequences)
        last = max(s for p in packages for s in p.sequences)
        first_lsn = naming.format_lsn(min(p.first_commit_lsn for p in packages))
        last_lsn = naming.format_lsn(max(p.last_commit_lsn for p in packages))
        table = self.applier.qualified_name
        return StreamApplyError(
            f"table {table} (target {self.applier.target.name}): cannot apply stream sequences {first}-{last} "
            f"(commit LSN {first_lsn} to {last_lsn}){attempts}: {type(error).__name__}: {_one_line(error)}. "
            "The messages stay unacknowledged and are replayed by the next run; fix the cause and restart, or set "
            "on_error: retry or dead_letter for this table", table, first, last)


def _combine(batches: list[AppliedBatch]) -> AppliedBatch | None:
    if not batches:
        return None
    toast = ToastStats()
    seconds: dict[str, float] = {}
    for batch in batches:
        for name in ("from_batch", "from_target", "from_source", "missing_at_source"):
            setattr(toast, name, getattr(toast, name) + getattr(batch.toast, name))
        for name, value in batch.seconds.items():
            seconds[name] = seconds.get(name, 0.0) + value
    truncates = [b.truncated_at for b in batches if b.truncated_at is not None]
    load_paths = sorted({b.load_path for b in batches if b.load_path is not None})
    return AppliedBatch(batches[-1].schema, sum(b.rows for b in batches), max(truncates) if truncates else None,
                        toast, seconds, load_path=",".join(load_paths) or None)


async def _settled(early: Awaitable[PreparedBatch | None] | None) -> PreparedBatch | None:
    if early is None:
        return None
    try:
        return await early
    except Exception as error:
        _log.debug("early preparation failed; the batch is prepared again", error=_one_line(error))
        return None


def _one_line(error: BaseException | None) -> str:
    text = str(error)
    if isinstance(error, PythonException):
        # An executor's traceback: its last line is the error itself.
        text = text.strip().splitlines()[-1]
    return " ".join(text.split())
