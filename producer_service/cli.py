"""`siphon-producer run --config siphon.yaml`: runs until SIGTERM/SIGINT, then flushes, acks and exits 0."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time

import psycopg
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_exponential

from producer_service.connecting import AuthenticationError, is_refused_login
from producer_service.metrics import EndpointError
from producer_service.ownership import LockHeldError
from producer_service.publication import SourceSetupError
from producer_service.service import ProducerService
from siphon_core import logs
from siphon_core.config import ConfigError, SiphonConfig, load_config
from siphon_core.queue import QueueError
from siphon_core.replication import ReplicationError

log = logs.get_logger("producer")

# Failures worth a reconnect: the source or the queue went away for a while.
_TRANSIENT = (psycopg.OperationalError, ReplicationError, QueueError, ConnectionError, OSError)


class _NatsClientLines(logging.Handler):
    """nats-py logs every failed reconnect attempt with a traceback, two a second while NATS is
    away; one structured line per new error, and the same error again at most every 30 s, keep the
    reason findable without burying the line that says why the producer stopped."""

    repeat_seconds = 30.0

    def __init__(self) -> None:
        super().__init__()
        self._last: tuple[str, str] | None = None
        self._last_at = 0.0
        self._repeats = 0

    def emit(self, record: logging.LogRecord) -> None:
        error = record.exc_info[1] if record.exc_info else None
        line = (record.getMessage(), repr(error) if error is not None else "")
        now = time.monotonic()
        extra = {}
        if line == self._last:
            if now - self._last_at < self.repeat_seconds:
                self._repeats += 1
                return
            extra = {"repeated_since_last_line": self._repeats}
        self._repeats = 0
        self._last, self._last_at = line, now
        log.warning(line[0], source="nats-py", error=line[1], **extra)


async def run_until_stopped(config: SiphonConfig, accept_slot_loss: bool = False,
                            config_path: str | None = None) -> int:
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    service: ProducerService | None = None

    def on_signal() -> None:
        stopping.set()
        if service is not None:
            service.request_stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)

    def on_hangup() -> None:
        if service is not None:
            service.request_config_check()

    loop.add_signal_handler(signal.SIGHUP, on_hangup)

    async def until_stopped(seconds: float) -> None:
        """tenacity's sleep between attempts: a stop request ends it at once."""
        try:
            await asyncio.wait_for(stopping.wait(), timeout=seconds)
        except TimeoutError:
            pass

    def reconnecting(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        log.warning("connection lost; reconnecting", attempt=state.attempt_number,
                    retry_in_seconds=state.upcoming_sleep, error=str(error))

    retries = config.producer.connect_retries
    retrying = AsyncRetrying(
        retry=retry_if_exception(_worth_reconnecting),
        stop=stop_after_attempt(retries + 1),
        wait=wait_exponential(multiplier=0.5, max=30.0),
        sleep=until_stopped,
        before_sleep=reconnecting,
        reraise=True,
    )
    attempts = 0
    try:
        async for attempt in retrying:
            if stopping.is_set():
                return 0
            with attempt:
                attempts = attempt.retry_state.attempt_number
                service = ProducerService(config, accept_slot_loss=accept_slot_loss, config_path=config_path)
                try:
                    await service.run()
                    return 0
                finally:
                    # Tables added or removed while it streamed stay so after a reconnect.
                    config = service.config
                    if service.recorded_slot_loss:
                        # The acknowledgement covered the loss just recorded, not one met later.
                        accept_slot_loss = False
                    if service.confirmed_lsn:
                        # A stream that ran long enough to confirm progress earns a fresh retry budget.
                        attempt.retry_state.attempt_number = 1
    except AuthenticationError as error:
        log.error("the source refused the login; not retrying", error=str(error))
        return 3
    except _TRANSIENT as error:
        if isinstance(error, QueueError) and is_refused_login(error):
            log.error("NATS refused the login; not retrying", error=str(error))
            return 3
        log.error("giving up after repeated connection failures", attempts=attempts, error=str(error))
        return 1
    return 0


def _worth_reconnecting(error: BaseException) -> bool:
    """The source or the queue went away for a while; a refused login is no such failure."""
    return isinstance(error, _TRANSIENT) and not (isinstance(error, QueueError) and is_refused_login(error))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="siphon-producer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="stream the configured tables to JetStream until stopped")
    run.add_argument("--config", required=True, help="path to siphon.yaml")
    run.add_argument("--log-level", default="INFO")
    run.add_argument("--accept-slot-loss", action="store_true",
                     help="with producer.on_slot_lost: stop, replace a lost replication slot once: record the gap "
                          "on the queue (the Dagster side then rebuilds every table) and stream from a new slot")
    args = parser.parse_args(argv)
    logs.configure(args.log_level)
    nats_logger = logging.getLogger("nats")
    nats_logger.handlers[:] = [_NatsClientLines()]
    nats_logger.propagate = False
    try:
        config = load_config(args.config)
    except ConfigError as error:
        # One line for one problem (a setting, a credentials file); a list for several.
        text = str(error)
        separator = "\n" if "\n" in text else " "
        print(f"siphon-producer: invalid configuration:{separator}{text}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(run_until_stopped(config, args.accept_slot_loss, args.config))
    except (LockHeldError, SourceSetupError, EndpointError) as error:
        print(f"siphon-producer: {error}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
