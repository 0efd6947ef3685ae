"""The queue seam: JetStream stream, subjects and consumers of one application.

The producer publishes through `JetStreamQueue.publish`; consumers pull through
`JetStreamQueue.pull_subscription`. Both sides derive every name from siphon_core.naming.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from dataclasses import dataclass

import nats
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    ConsumerInfo,
    DeliverPolicy,
    DiscardPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, NotFoundError

from siphon_core import naming
from siphon_core.config import QueueConfig
from siphon_core.queue_security import PlainTextRefused, QueueLogin, transport_is_tls
from siphon_core.redaction import redact_url

_nats_log = logging.getLogger("nats.aio.client")


class QueueError(RuntimeError):
    """The queue refused or lost a request; the message says which stream or subject."""


@dataclass(frozen=True)
class StreamSettings:
    application_identifier: str
    duplicate_window_seconds: int = 600
    replicas: int = 1
    max_message_bytes: int = 1_048_576
    max_consumers: int = 10_000

    @property
    def stream(self) -> str:
        return naming.stream_name(self.application_identifier)

    @property
    def subjects(self) -> list[str]:
        return [f"{naming.subject_prefix(self.application_identifier)}.>",
                f"siphon_dead_letter.{naming.escape_subject_token(self.application_identifier)}.>"]


# JetStream's error code for a stream (or account) that has as many consumers as it allows.
MAXIMUM_CONSUMERS_REACHED = 10026


class JetStreamQueue:
    def __init__(self, url: str, settings: StreamSettings, name: str = "siphon", login: QueueLogin | None = None) -> None:
        self.url = url
        self.settings = settings
        self._name = name
        self._login = login or QueueLogin(require_tls=url.lower().startswith("tls://"))
        self._nc: nats.NATS | None = None
        self._js: JetStreamContext | None = None
        # The stream was created or updated on this connection: a run's hundreds of consumers
        # share the connection, and each asking again would queue hundreds of stream updates.
        self._stream_ensured = False

    @classmethod
    def from_config(cls, config: QueueConfig, application_identifier: str, name: str = "siphon") -> JetStreamQueue:
        """The application's queue as `queue:` in siphon.yaml describes it, TLS and login included."""
        settings = StreamSettings(application_identifier, config.duplicate_window_seconds, config.replicas,
                                  config.max_message_bytes, config.max_consumers)
        return cls(config.url, settings, name=name, login=QueueLogin.from_config(config))

    async def connect(self, connect_timeout: float = 5.0) -> None:
        """Connects, retrying an unreachable server for as long as the caller waits; a refused login,
        a certificate that does not verify or a server without TLS (when TLS was asked for) fail at once:
        retrying them cannot help."""
        where = redact_url(self.url)
        refusal: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()

        async def on_error(error: BaseException) -> None:
            if _is_final(error) and not refusal.done():
                refusal.set_result(error)
            else:  # as nats-py's own callback would
                _nats_log.error("nats: encountered error", exc_info=error)

        client = self._login.client()
        connecting = asyncio.ensure_future(client.connect(
            self.url, name=self._name, connect_timeout=connect_timeout, error_cb=on_error,
            max_reconnect_attempts=-1, reconnect_time_wait=0.5, allow_reconnect=True,
            **self._login.connect_options(),
        ))
        try:
            await asyncio.wait({connecting, refusal}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            connecting.cancel()
            raise
        if refusal.done() and not connecting.done():
            connecting.cancel()
            await _close_quietly(client)
            raise QueueError(f"NATS at {where} {_describe_refusal(refusal.result())}") from None
        try:
            connecting.result()
        except Exception as error:  # nats-py raises several unrelated types here
            raise QueueError(f"cannot connect to NATS at {where}: {error}") from None
        if self._login.require_tls and transport_is_tls(client) is False:
            await _close_quietly(client)
            raise QueueError(f"NATS at {where}: the connection is not encrypted although TLS was configured; "
                             "refusing it")
        self._nc = client
        self._js = self._nc.jetstream(timeout=10.0)
        self._stream_ensured = False

    @property
    def is_connected(self) -> bool:
        return self._nc is not None and not self._nc.is_closed

    @property
    def js(self) -> JetStreamContext:
        if self._js is None:
            raise QueueError("queue is not connected")
        return self._js

    async def ensure_stream(self) -> None:
        """Creates the application's stream, or updates its subjects and limits; once per connection."""
        if self._stream_ensured:
            return
        await self._ensure_stream()
        self._stream_ensured = True

    async def _ensure_stream(self) -> None:
        config = StreamConfig(
            name=self.settings.stream,
            subjects=self.settings.subjects,
            storage=StorageType.FILE,
            num_replicas=self.settings.replicas,
            duplicate_window=float(self.settings.duplicate_window_seconds),
            max_msg_size=self.settings.max_message_bytes + 65_536,
            discard=DiscardPolicy.OLD,
            max_consumers=self.settings.max_consumers,
        )
        try:
            info = await self.js.stream_info(config.name)
        except NotFoundError:
            await self.js.add_stream(config)
            return
        ours = naming.subject_prefix(self.settings.application_identifier) + ".>"
        theirs = list(info.config.subjects or [])
        if theirs and theirs[0] != ours:
            # Identifiers that differ only in punctuation (`a.b.1`, `a_b_1`) share a stream name;
            # rewriting the other application's subjects would cut its producer off.
            raise QueueError(
                f"JetStream stream {config.name} belongs to application "
                f"{naming.application_of_subject(theirs[0])!r} (subjects {theirs[0]}), whose name collides with "
                f"{self.settings.application_identifier!r}; choose an application_identifier that differs in "
                "letters or digits")
        # Retention is the operator's to set (`nats stream edit`); an update must not reset it.
        for limit in ("max_age", "max_bytes", "max_msgs", "max_msgs_per_subject"):
            setattr(config, limit, getattr(info.config, limit))
        try:
            await self.js.update_stream(config)
        except BadRequestError:
            if info.config.max_consumers == config.max_consumers:
                raise
            # A server from before 2.12 cannot change a stream's consumer limit (nor does it set one
            # of its own); everything else is updated.
            config.max_consumers = info.config.max_consumers
            await self.js.update_stream(config)

    async def publish(self, subject: str, payload: bytes, message_id: str, timeout: float = 30.0) -> int:
        """Publishes and waits for the stream's ack; returns the stream sequence."""
        ack = await self.js.publish(subject, payload, timeout=timeout, stream=self.settings.stream,
                                    headers={"Nats-Msg-Id": message_id})
        return ack.seq

    # -- reading single messages (gap records) ---------------------------------------------------

    async def last_sequence(self) -> int | None:
        """The stream's last sequence: 0 when it never held a message (sequences survive purges and
        age limits, so this remembers that the application streamed); None without a stream."""
        try:
            info = await self.js.stream_info(self.settings.stream)
        except NotFoundError:
            return None
        return int(info.state.last_seq or 0)

    async def last_message(self, subject: str) -> tuple[int, bytes] | None:
        """The newest message on `subject` (sequence, data), or None."""
        try:
            message = await self.js.get_last_msg(self.settings.stream, subject)
        except NotFoundError:
            return None
        return int(message.seq or 0), message.data or b""

    async def last_table_message(self) -> tuple[int, bytes] | None:
        """The newest message on any table subject (`siphon.<application>.<schema>.<table>`), or None."""
        return await self.last_message(f"{naming.subject_prefix(self.settings.application_identifier)}.*.*")

    async def messages_after(self, subject: str, sequence: int, limit: int = 1000) -> list[tuple[int, bytes]]:
        """Messages on `subject` with a stream sequence above `sequence`, oldest first, at most `limit`
        (for a subject that holds few messages: one request per message)."""
        found: list[tuple[int, bytes]] = []
        while len(found) < limit:
            try:
                message = await self.js.get_msg(self.settings.stream, seq=sequence + 1, subject=subject, next=True)
            except NotFoundError:
                break
            sequence = int(message.seq or 0)
            found.append((sequence, message.data or b""))
        return found

    async def ensure_consumer(self, durable: str, subject: str, ack_wait_seconds: float = 300.0,
                              max_ack_pending: int = 10_000) -> ConsumerInfo:
        """The durable consumer's info, the consumer created first when it does not exist."""
        config = ConsumerConfig(
            durable_name=durable,
            filter_subject=subject,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=ack_wait_seconds,
            max_ack_pending=max_ack_pending,
            max_deliver=-1,
        )
        try:
            return await self.js.consumer_info(self.settings.stream, durable)
        except NotFoundError:
            return await self.add_consumer(config)

    async def add_consumer(self, config: ConsumerConfig) -> ConsumerInfo:
        """Creates a consumer; a stream at its limit of consumers is a QueueError that says so."""
        try:
            return await self.js.add_consumer(self.settings.stream, config)
        except BadRequestError as error:
            if error.err_code != MAXIMUM_CONSUMERS_REACHED:
                raise
            raise QueueError(
                f"JetStream stream {self.settings.stream} has as many consumers as it allows, so consumer "
                f"{config.durable_name} cannot be made: Siphon keeps one per table and target. Set "
                "queue.max_consumers in siphon.yaml above the number of tables times targets (the stream takes it "
                "when the producer or a run starts), and check the account's JetStream limits; the streaming "
                "sensor removes the consumers of tables no longer replicated once they are idle, and "
                "`nats consumer rm` removes one at once") from error

    async def pull_subscription(self, durable: str, subject: str) -> JetStreamContext.PullSubscription:
        await self.ensure_consumer(durable, subject)
        return await self.bind(durable)

    async def bind(self, durable: str) -> JetStreamContext.PullSubscription:
        """A pull subscription on an existing durable consumer."""
        return await self.js.pull_subscribe_bind(durable=durable, stream=self.settings.stream)

    async def pending(self, durable: str) -> int:
        """Messages not yet delivered plus delivered but not acked, for one consumer."""
        info = await self.js.consumer_info(self.settings.stream, durable)
        return int(info.num_pending or 0) + int(info.num_ack_pending or 0)

    async def consumers(self) -> list[ConsumerInfo]:
        """Every consumer of the stream (the server answers 256 at a time); none before the stream
        exists."""
        found: list[ConsumerInfo] = []
        while True:
            try:
                page = await self.js.consumers_info(self.settings.stream, offset=len(found))
            except NotFoundError:
                return found
            found += page
            if not page:
                return found

    async def delete_consumer(self, durable: str) -> bool:
        """Deletes a consumer and its position; False when there was none."""
        try:
            return await self.js.delete_consumer(self.settings.stream, durable)
        except NotFoundError:
            return False

    async def close(self) -> None:
        if self._nc is not None and not self._nc.is_closed:
            try:
                await asyncio.wait_for(self._nc.drain(), timeout=10.0)
            except Exception:
                await self._nc.close()
        self._nc = None
        self._js = None
        self._stream_ensured = False


# -- positions, for the checks (siphon_dagster.checks) -------------------------------------------


async def connect_within(queue: JetStreamQueue, seconds: float = 10.0) -> None:
    """Connects, or raises QueueError after `seconds` (a first connection to a server that is down
    would otherwise be retried forever)."""
    try:
        await asyncio.wait_for(queue.connect(), seconds)
    except TimeoutError:
        raise QueueError(f"cannot connect to NATS at {redact_url(queue.url)} within {seconds:.0f}s") from None


@dataclass(frozen=True)
class ConsumerPosition:
    """Where a durable consumer stands in the stream."""

    ack_floor: int  # every message of its subject up to this stream sequence is acked
    pending: int  # not delivered yet, plus delivered and not acked


async def last_sequence(queue: JetStreamQueue, subject: str) -> int:
    """The stream sequence of the subject's last message; 0 when it has none."""
    try:
        message = await queue.js.get_last_msg(queue.settings.stream, subject)
    except NotFoundError:
        return 0
    return int(message.seq or 0)


async def consumer_position(queue: JetStreamQueue, durable: str) -> ConsumerPosition | None:
    """None when the consumer does not exist (its table was never streamed to that target)."""
    try:
        info = await queue.js.consumer_info(queue.settings.stream, durable)
    except NotFoundError:
        return None
    floor = info.ack_floor.stream_seq if info.ack_floor is not None else 0
    return ConsumerPosition(int(floor or 0), int(info.num_pending or 0) + int(info.num_ack_pending or 0))


async def oldest_after(queue: JetStreamQueue, subject: str, sequence: int) -> float | None:
    """The stored time (Unix seconds) of the subject's first message after `sequence`, or None."""
    try:
        message = await queue.js.get_msg(queue.settings.stream, seq=sequence + 1, subject=subject, next=True)
    except NotFoundError:
        return None
    return message.time.timestamp() if message.time is not None else None

def _is_final(error: BaseException) -> bool:
    if isinstance(error, (PlainTextRefused, ssl.SSLError, nats.errors.AuthorizationError)):
        return True
    text = str(error).lower()
    return "authorization violation" in text or "authentication" in text


def _describe_refusal(error: BaseException) -> str:
    if isinstance(error, PlainTextRefused):
        return "offers no TLS, and queue: asks for TLS (a tls:// URL or tls_* settings); not connecting in plain text"
    if isinstance(error, ssl.SSLError):
        return (f"failed the TLS handshake: {error}; check queue.tls_ca_file (the CA that signed the server's "
                "certificate) and that the certificate names the URL's host")
    return (f"refused the login ({str(error).strip()}); check queue.user/password, token, nkey_seed_file or "
            "creds_file in siphon.yaml")


async def _close_quietly(client: nats.NATS) -> None:
    try:
        await asyncio.wait_for(client.close(), timeout=5.0)
    except Exception:
        pass
